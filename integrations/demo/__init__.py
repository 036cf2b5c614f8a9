"""``python -m hearth_llm.integrations.demo`` (``make demo``): RAG and an agent on one in-process engine.

A bundled handbook (eleven short pages about a made-up kettle, the Larkspur Wren) is indexed with
the default embedding model. Then, all on the one shared SmolLM2 engine of this process, no server:

1. a LangChain RAG chain (InMemoryVectorStore + HearthEmbeddings + ChatHearth, LCEL) answers a few
   questions, its tokens streamed to the terminal;
2. a LlamaIndex query engine (VectorStoreIndex + HearthEmbedding + HearthLLM) answers the same
   questions, all at once, so the engine decodes them in the same steps;
3. a LangChain agent calls a Python tool (its first call forced, since a 135M model rarely calls
   tools on its own) and answers with the tool's result;
4. a stats line from the engine's counters: tokens/s, prefix-cache hit rate, requests batched together.

>>> from hearth_llm.integrations.demo import main
>>> main(["--questions", "1", "--max-tokens", "40"])      # the short variant the tests run
"""
from __future__ import annotations

import argparse
import asyncio
import time
from importlib import resources

import llama_index.core
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.documents import Document
from langchain_core.messages import ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import tool
from langchain_core.vectorstores import InMemoryVectorStore

from hearth_llm.engine import LLM
from hearth_llm.integrations.langchain import ChatHearth, HearthEmbeddings
from hearth_llm.integrations.llama_index import HearthEmbedding, HearthLLM

QUESTIONS = [
    "How often should I descale the kettle if my water is hard?",
    "How much does express delivery cost?",
    "What does error code E1 mean?",
]
AGENT_QUESTION = "The green tea preset heats water to 80 °C. What is that in degrees Fahrenheit?"
# The wording, one retrieved page and a blank line as the stop were chosen by trying what a 135M
# model answers best; both frameworks use the same wording, so their prompts share cached blocks.
RAG_SYSTEM = ("You are a helpful assistant for the Larkspur Wren kettle. "
              "Answer in one short sentence, using only the handbook.")
RAG_HUMAN = "Handbook:\n{context}\n\nQuestion: {question}"
STOP_AT_BLANK_LINE = ["\n\n"]
RULE = "-" * 78


def main(argv: list[str] | None = None) -> None:
    """Run the whole demo, printing as it goes; ``--questions`` and ``--max-tokens`` shorten it."""
    args = _parse_args(argv)
    questions = QUESTIONS[:args.questions]
    corpus = load_corpus()
    print(f"hearth-llm demo: {len(corpus)} handbook pages, {len(questions)} question(s), "
          "LangChain and LlamaIndex on one in-process engine.\n", flush=True)
    store = _section("Indexing the handbook with HearthEmbeddings (all-MiniLM-L6-v2)",
                     lambda: index_with_langchain(corpus))
    # Every ChatHearth and HearthLLM below runs on this engine; this handle loads it and reads its counters.
    llm = _section("Loading SmolLM2-135M-Instruct into this process", lambda: LLM("default", show_progress=False))
    try:
        before, started = llm.stats(), time.perf_counter()
        _section("LangChain RAG chain: retriever | prompt | ChatHearth | StrOutputParser, streamed",
                 lambda: answer_with_langchain(store, questions, args.max_tokens))
        _section("LlamaIndex query engine: VectorStoreIndex + HearthLLM, the questions all at once",
                 lambda: answer_with_llama_index(corpus, questions, args.max_tokens))
        _section("LangChain agent (create_agent) with a Python tool", run_agent_step)
        print(stats_line(before, llm.stats(), time.perf_counter() - started), flush=True)
    finally:
        llm.close()


def load_corpus() -> list[tuple[str, str]]:
    """The bundled handbook pages as (file name, text), in file-name order."""
    folder = resources.files(__package__) / "corpus"
    return sorted((page.name, page.read_text(encoding="utf-8")) for page in folder.iterdir()
                  if page.name.endswith(".md"))


def index_with_langchain(corpus: list[tuple[str, str]]) -> InMemoryVectorStore:
    documents = [Document(page_content=text, metadata={"source": name}) for name, text in corpus]
    return InMemoryVectorStore.from_documents(documents, HearthEmbeddings())


def answer_with_langchain(store: InMemoryVectorStore, questions: list[str], max_tokens: int) -> None:
    """LCEL: the retrieved page and the question fill a prompt; the answer streams token by token."""
    prompt = ChatPromptTemplate.from_messages([("system", RAG_SYSTEM), ("human", RAG_HUMAN)])
    chat = ChatHearth(temperature=0, max_tokens=max_tokens, stop=STOP_AT_BLANK_LINE)
    retriever = store.as_retriever(search_kwargs={"k": 1})
    chain = ({"context": retriever | _join_pages, "question": RunnablePassthrough()}
             | prompt | chat | StrOutputParser())
    for question in questions:
        print(f"Q: {question}\nA: ", end="", flush=True)
        for token in chain.stream(question):
            print(token, end="", flush=True)
        print("\n", flush=True)


def answer_with_llama_index(corpus: list[tuple[str, str]], questions: list[str], max_tokens: int) -> None:
    """The same pages in a LlamaIndex index and the same prompt wording; the questions go in
    together, so the engine decodes them in the same steps."""
    documents = [llama_index.core.Document(text=text, metadata={"file_name": name},
                                           excluded_llm_metadata_keys=["file_name"]) for name, text in corpus]
    index = llama_index.core.VectorStoreIndex.from_documents(documents, embed_model=HearthEmbedding())
    template = llama_index.core.ChatPromptTemplate.from_messages(
        [("system", RAG_SYSTEM), ("user", RAG_HUMAN.format(context="{context_str}", question="{query_str}"))])
    llm = HearthLLM(temperature=0, max_tokens=max_tokens, stop=STOP_AT_BLANK_LINE)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=1, text_qa_template=template)

    async def ask_all():
        return await asyncio.gather(*(query_engine.aquery(question) for question in questions))

    for question, response in zip(questions, asyncio.run(ask_all())):
        sources = ", ".join(node.metadata["file_name"] for node in response.source_nodes)
        print(f"Q: {question}\nA: {str(response).strip()}\n   (retrieved: {sources})\n", flush=True)


@tool
def celsius_to_fahrenheit(celsius: float) -> float:
    """Convert a temperature from degrees Celsius to degrees Fahrenheit."""
    return round(celsius * 9 / 5 + 32, 1)


@wrap_model_call
def call_a_tool_first(request, handler):
    """SmolLM2-135M rarely calls a tool unasked: force a call (by grammar) until a tool has answered."""
    if not any(isinstance(message, ToolMessage) for message in request.messages):
        request = request.override(tool_choice="any")
    return handler(request)


def run_agent_step() -> None:
    """The model calls the tool, LangChain runs it, the model answers with its result."""
    # The model echoes the chat template's closing tag after a tool result; stop there.
    chat = ChatHearth(temperature=0, max_tokens=48, stop=["</tool_response>"])
    agent = create_agent(chat, tools=[celsius_to_fahrenheit], middleware=[call_a_tool_first])
    print(f"User: {AGENT_QUESTION}", flush=True)
    for message in agent.invoke({"messages": [("human", AGENT_QUESTION)]})["messages"][1:]:
        for call in getattr(message, "tool_calls", None) or []:
            print(f"Tool call: {call['name']}({call['args']})", flush=True)
        if isinstance(message, ToolMessage):
            print(f"Tool result: {message.content}", flush=True)
        elif message.content:
            print(f"Agent: {message.content.strip()}", flush=True)
    print(flush=True)


def stats_line(before: dict, after: dict, elapsed: float) -> str:
    """What the engine counted between two ``stats()`` snapshots: generation speed, prefix reuse, batching."""
    def grown(key: str) -> int:
        return after[key] - before.get(key, 0)

    num_tokens, num_steps = grown("num_generation_tokens"), max(grown("num_steps"), 1)
    hits, queries = grown("prefix_cache_hits"), grown("prefix_cache_queries")
    return (f"stats: {num_tokens} tokens generated in {elapsed:.1f} s = {num_tokens / elapsed:.1f} tok/s | "
            f"prefix-cache hit rate {hits / max(queries, 1):.0%} ({hits} of {queries} prompt tokens) | "
            f"requests batched together: up to {after['max_num_scheduled_requests']} per step, "
            f"{grown('num_scheduled_requests') / num_steps:.1f} on average over {num_steps} steps")


def _join_pages(documents: list[Document]) -> str:
    return "\n\n".join(document.page_content for document in documents)


def _section(title: str, run):
    print(f"{RULE}\n{title}\n{RULE}", flush=True)
    started = time.perf_counter()
    result = run()
    print(f"({time.perf_counter() - started:.1f} s)\n", flush=True)
    return result


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hearth_llm.integrations.demo",
                                     description="RAG and an agent through LangChain and LlamaIndex on one engine.")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1),
                        help="how many of the RAG questions to ask")
    parser.add_argument("--max-tokens", type=int, default=96, help="most tokens per RAG answer")
    return parser.parse_args(argv)
