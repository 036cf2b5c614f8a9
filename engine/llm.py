"""``LLM``: offline batches through the process's shared engine, with a progress bar."""
from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from .beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .errors import RequestFailedError
from .outputs import CompletionOutput, RequestOutput
from .chat.prompt import ChatPrompt
from .lora.request import LoRARequest
from .registry import RequestStream, get_engine
from .sampling_params import SamplingParams


class LLM:
    """Generate for many prompts at once; they are batched continuously inside the engine.

    >>> from hearth_llm.engine import LLM, SamplingParams
    >>> llm = LLM()                                   # SmolLM2-135M-Instruct, bundled
    >>> outs = llm.generate(["The sky is", "Paris is"], SamplingParams(temperature=0, max_tokens=16))
    >>> print(outs[0].outputs[0].text)
    >>> llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].outputs[0].text
    'The capital of France is Paris.'

    Keyword arguments are :class:`EngineConfig` fields (``max_num_seqs=``, ``kv_cache_memory=``, ...).
    ``LLM``, ``AsyncLLM`` and the LangChain/LlamaIndex classes on the same model and config share
    one engine (see :func:`get_engine`); the model loads here, so a bad model path raises now.
    """

    def __init__(self, model: str = "default", **engine_kwargs) -> None:
        self._core = get_engine(model, **engine_kwargs)
        self._core.attach()
        try:
            self._core.wait_until_started()
        except BaseException:
            self._core.detach()
            raise
        self.config = self._core.config

    @property
    def engine(self):
        """The underlying :class:`LLMEngine`, for reading (tokenizer, limits); its thread drives it."""
        return self._core.engine

    @property
    def tokenizer(self):
        return self._core.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Invalid input raises before anything is queued; a
        request that fails later (say, its grammar does not compile) comes back with
        ``finish_reason="abort"`` and the error in ``stop_reason``, the others unharmed.

        ``lora_request``: one :class:`LoRARequest` for every prompt or one per prompt (None: the
        base model), with ``enable_lora=True``; ``RequestOutput.lora_name`` says which answered."""
        return self._run(_as_prompt_list(prompts), sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        The engine renders each conversation on its thread (the same place as every other prompt);
        ``RequestOutput.prompt`` is the rendered text. A conversation the template rejects raises
        ``ValueError`` and none of the batch is generated."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("messages must not be empty")
        prompts = [ChatPrompt(conversation, add_generation_prompt, chat_template_kwargs, tools)
                   for conversation in conversations]
        return self._run(prompts, sampling_params, use_tqdm, None, lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check a PEFT adapter now, so later requests may name it (``LoRARequest(name)``);
        ``ValueError`` naming the adapter and the problem if it is bad.

        >>> llm.add_lora(LoRARequest("sql", "/adapters/sql-lora"))
        >>> llm.list_loras()
        ['sql']
        """
        self._lora_manager().add(lora_request)

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter; requests already running with it finish with it. False if unknown."""
        return self._lora_manager().remove(name)

    def list_loras(self) -> list[str]:
        """Names of the adapters this engine knows."""
        return self._lora_manager().list_names()

    def _lora_manager(self):
        manager = self._core.engine.lora_manager
        if manager is None:
            raise ValueError("LoRA is off for this engine; create it with enable_lora=True")
        return manager

    def beam_search(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt (text or token ids), best
        first, by beam search as HF ``generate(num_beams=..., do_sample=False)`` does it; see
        :mod:`.beam_search`.

        >>> [out] = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=4, max_tokens=8))
        >>> out.sequences[0].text, out.sequences[0].score
        """
        prompt_list = [list(prompt) if not isinstance(prompt, str) else prompt for prompt in _as_prompt_list(prompts)]
        return beam_search(self._core, prompt_list, params)

    def stats(self) -> dict:
        """Scheduler and KV cache counters: running/waiting, free/total blocks, preemptions, prefix hits."""
        return self._core.stats()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory once its running requests finish: level 1 drops the KV cache (on a
        GPU the weights move to pinned host memory), level 2 the weights too. The next request (from
        any handle on this engine) or :meth:`wake_up` wakes it; ``keep_alive=`` does this when idle."""
        self._core.sleep(level)

    def wake_up(self) -> None:
        """Bring the weights and a fresh KV cache back now, instead of at the next request."""
        self._core.wake_up()

    def close(self) -> None:
        """Release this handle; the shared engine stops when its last handle closes."""
        if self._core is not None:
            self._core.detach()
            self._core = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _run(self, prompts, sampling_params, use_tqdm, priority, lora_request=None) -> list[RequestOutput]:
        params_list = _params_for(prompts, sampling_params)
        lora_requests = _loras_for(prompts, lora_request)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        streams = self._core.add_requests(list(prompts), params_list, priorities=priorities,
                                          lora_requests=lora_requests)
        try:
            with tqdm(total=len(streams), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                outputs = []
                for prompt, params, stream in zip(prompts, params_list, streams):
                    outputs.append(_collect(prompt, params, stream))
                    bar.update()
            return outputs
        finally:
            for stream in streams:
                stream.close()


def _collect(prompt, params: SamplingParams, stream: RequestStream) -> RequestOutput:
    texts = [[] for _ in range(params.n)]
    token_ids = [[] for _ in range(params.n)]
    logprobs = [[] for _ in range(params.n)]
    finish = [(None, None)] * params.n
    last = None
    try:
        outputs = list(stream)
    except RequestFailedError as error:  # one failed request must not sink the whole batch
        return RequestOutput(request_id=stream.request_id, prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=[], finished=True, outputs=[
                                 CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort",
                                                  stop_reason=str(error)) for i in range(params.n)])
    for out in outputs:
        texts[out.index].append(out.delta_text)
        token_ids[out.index].extend(out.delta_token_ids)
        if out.logprobs:
            logprobs[out.index].extend(out.logprobs)
        if out.finish_reason is not None:
            finish[out.index] = (out.finish_reason, out.stop_reason)
        last = out
    outputs = [
        CompletionOutput(index=i, text="".join(texts[i]), token_ids=token_ids[i], finish_reason=finish[i][0],
                         stop_reason=finish[i][1], logprobs=logprobs[i] if params.logprobs is not None else None)
        for i in range(params.n)
    ]
    return RequestOutput(
        request_id=stream.request_id,
        prompt=last.prompt,  # the text as given, or as the chat template rendered it; None for token ids
        prompt_token_ids=list(last.prompt_token_ids or []),
        outputs=outputs,
        num_cached_tokens=last.usage.cached_tokens if last.usage else 0,
        prompt_logprobs=last.prompt_logprobs,
        finished=True,
        lora_name=last.lora_name,
    )


def _loras_for(prompts, lora_request) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * len(prompts)
    if isinstance(lora_request, (str, bytes)):
        raise ValueError(f"lora_request must be a LoRARequest or a list of them, got {lora_request!r}")
    loras = list(lora_request)
    if len(loras) != len(prompts):
        raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
    return loras


def _params_for(prompts, sampling_params) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * len(prompts)
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(prompts)
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
    return params


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("prompts: a flat list of ints is ambiguous; pass [[ids...]] for one tokenized prompt")
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts must not be empty")
    return prompt_list
