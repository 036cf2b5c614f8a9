"""Tools in the prompt and ``tool_choice`` as a decoding constraint.

Tools reach the prompt through the chat template's ``tools`` argument. A template that never
mentions tools (SmolLM2's ChatML) gets the hermes convention instead, as a system prompt:

    You are a function calling AI model. You are provided with function signatures within
    <tools></tools> XML tags. ... For each function call return a json object with function name
    and arguments within <tool_call></tool_call> XML tags: <tool_call>{"name": ..., "arguments": {...}}</tool_call>

``tool_choice="required"`` (or ``"any"``) and a named function become a grammar, so even a small
model emits a well-formed call with schema-valid arguments.
"""
from __future__ import annotations

import json
import keyword

from .structured_output import StructuredOutput
from .tool_parsers import select_tool_parser

HERMES_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>"
)


def normalize_tools(tools: list) -> list[dict]:
    """OpenAI-style ``{"type": "function", "function": {name, description, parameters}}`` entries;
    ``ValueError`` naming ``tools`` when an entry has no name."""
    normalized = []
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools: each tool needs a function name, got {tool!r}")
        name, description = function["name"], function.get("description") or ""
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(description, str):
            raise ValueError(f"tools: the description of {name!r} must be a string, got {type(description).__name__}")
        if not isinstance(parameters, dict) or not _is_json(parameters):
            raise ValueError(f"tools: the parameters of {name!r} must be a JSON schema object, got {parameters!r:.80}")
        normalized.append({"type": "function", "function": {
            "name": name, "description": description, "parameters": parameters}})
    return normalized


def _is_json(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def template_supports_tools(tokenizer) -> bool:
    return chat_template_supports_tools(getattr(tokenizer, "chat_template", None))


def chat_template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template reads its ``tools`` argument (else tools are offered the hermes way)."""
    return "tools" in (chat_template or "")


def tool_parser_for(chat_template: str | None, model_type: str | None) -> str:
    """The tool-call format a model writes. A template that never mentions tools gets the hermes
    system prompt (see :func:`render_chat_with_tools`), so the model is asked for, and read in, hermes.

    >>> tool_parser_for("{{ messages }}", "mistral")
    'hermes'
    >>> tool_parser_for("{% if tools %}[TOOL_CALLS]{% endif %}", "mistral")
    'mistral'
    """
    if not chat_template_supports_tools(chat_template):
        return "hermes"
    return select_tool_parser(chat_template, model_type)


TOOL_CHOICE_KEYWORDS = ("auto", "none", "required")


def normalize_tool_choice(tool_choice, tools: list[dict]) -> str:
    """``"auto"``, ``"none"``, ``"required"`` or the name of one of ``tools``.

    Accepts OpenAI's and LangChain's forms: None (``"auto"``), True/False (``"required"``/``"auto"``),
    ``"any"`` (``"required"``), a tool's name, ``{"type": "function", "function": {"name": ...}}``.
    A name that is not among ``tools`` raises ``ValueError`` naming ``tool_choice``; whether a forced
    choice has any tool to call is checked where the call is made (:func:`tool_choice_constraint`).

    >>> normalize_tool_choice({"type": "function", "function": {"name": "add"}}, [{"name": "add"}])
    'add'
    >>> normalize_tool_choice("any", [])
    'required'
    """
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, bool):
        return "required" if tool_choice else "auto"
    if tool_choice == "any":
        return "required"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function", tool_choice)
        tool_choice = function.get("name") if isinstance(function, dict) else None
    if tool_choice in TOOL_CHOICE_KEYWORDS:
        return tool_choice
    names = [tool["function"]["name"] for tool in normalize_tools(tools)]
    if not isinstance(tool_choice, str) or tool_choice not in names:
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' (or 'any', True) or the name of one of "
                         f"the tools {names}; got {tool_choice!r}")
    return tool_choice


def render_chat_with_tools(tokenizer, conversation: list[dict], tools: list | None,
                           add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> str:
    """The prompt text for a conversation that may offer tools and contain tool calls/results."""
    tools = normalize_tools(tools) if tools else None
    kwargs = dict(chat_template_kwargs or {})
    if template_supports_tools(tokenizer):
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    messages = [_as_hermes_message(message) for message in conversation]
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        instructions = HERMES_SYSTEM_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{instructions}"}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def _as_hermes_message(message: dict) -> dict:
    """Assistant tool calls and tool results as plain-text turns a tool-unaware template can show."""
    role, content = message.get("role"), message.get("content") or ""
    if role == "assistant" and message.get("tool_calls"):
        calls = "".join(
            "<tool_call>\n" + json.dumps({"name": call["function"]["name"] if "function" in call else call["name"],
                                          "arguments": _arguments_of(call)}, ensure_ascii=False) + "\n</tool_call>"
            for call in message["tool_calls"])
        return {"role": "assistant", "content": f"{content}{calls}" if content else calls}
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}


def _arguments_of(call: dict) -> dict:
    arguments = call["function"].get("arguments") if "function" in call else call.get("args", call.get("arguments"))
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return {"_raw": arguments}
    return arguments or {}


def tool_choice_constraint(tools: list | None, tool_choice, tool_parser: str = "hermes") -> StructuredOutput | None:
    """The grammar that enforces ``tool_choice``; None for "auto"/"none" (the model decides or no tools).

    >>> tool_choice_constraint([{"name": "add", "parameters": {...}}], "required")
    StructuredOutput(grammar='root ::= ...')
    """
    if tool_choice in (None, "auto", "none"):
        return None
    tools = normalize_tools(tools)
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs at least one tool")
    if tool_choice in ("required", "any"):
        chosen = tools
    else:
        name = tool_choice.get("function", tool_choice).get("name") if isinstance(tool_choice, dict) else tool_choice
        chosen = [tool for tool in tools if tool["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools "
                             f"{[t['function']['name'] for t in tools]}")
    return StructuredOutput(grammar=_call_grammar(chosen, tool_parser))


def _call_grammar(tools: list[dict], tool_parser: str) -> str:
    import xgrammar as xgr

    if tool_parser == "qwen3_coder":
        return str(_qwen3_coder_grammar(tools))
    if tool_parser == "gemma":
        return str(_gemma_grammar(tools))
    arguments_key = {"hermes": "arguments", "llama3_json": "parameters", "granite": "arguments",
                     "phi4_mini": "arguments"}.get(tool_parser)
    if arguments_key is None:
        raise ValueError(f"tool_choice other than 'auto'/'none' is supported for tool_parser 'hermes', "
                         f"'llama3_json', 'granite', 'phi4_mini', 'qwen3_coder' and 'gemma', not {tool_parser!r}")
    schema = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: tool["function"]["parameters"]},
        "required": ["name", arguments_key],
    } for tool in tools]}
    call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    wrapper = {"hermes": ("<tool_call>\\n", "\\n</tool_call>"), "granite": ("<|tool_call|>[", "]"),
               "phi4_mini": ("functools[", "]")}.get(tool_parser)
    if wrapper is not None:
        call = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f'root ::= "{wrapper[0]}"'), call,
                                  xgr.Grammar.from_ebnf(f'root ::= "{wrapper[1]}"'))
    return str(call)


def _qwen3_coder_grammar(tools: list[dict]):
    """A call in Qwen3-Coder's XML: ``<tool_call>\\n<function=name>\\n`` then each parameter in the
    schema's order (the required ones always) as ``<parameter=key>\\nvalue\\n</parameter>\\n``.

    A string value is one line without ``<`` (a forced call gives a small model no room to wander
    into markup; multi-line strings are left to unforced calls); a string enum one of its values;
    any other value JSON of its schema, as the parser reads it back.
    """
    import xgrammar as xgr

    def literal(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    def value(schema: dict):
        if schema.get("type") == "string" and isinstance(schema.get("enum"), list) and schema["enum"]:
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(str(v)) for v in schema["enum"]))
        if schema.get("type") == "string":
            return xgr.Grammar.from_ebnf(r'root ::= [^<\n]*')
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)

    def function(tool: dict):
        name, parameters = tool["function"]["name"], tool["function"]["parameters"]
        required = set(parameters.get("required") or [])
        parts = [literal(f"<tool_call>\n<function={name}>\n")]
        for key, schema in (parameters.get("properties") or {}).items():
            parameter = xgr.Grammar.concat(literal(f"<parameter={key}>\n"), value(schema if isinstance(schema, dict)
                                                                                  else {}), literal("\n</parameter>\n"))
            parts.append(parameter if key in required else xgr.Grammar.union(parameter, literal("")))
        parts.append(literal("</function>\n</tool_call>"))
        return xgr.Grammar.concat(*parts)

    calls = [function(tool) for tool in tools]
    return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)


def _gemma_grammar(tools: list[dict]):
    """A call in Gemma's fenced block: a ``tool_code`` fence line, ``name(key=value, ...)``, a closing
    fence line; the keyword arguments in the schema's order (the required ones always), each value JSON of its
    schema (the gemma parser reads JSON literals, ``true``/``false``/``null`` included, back as-is;
    the one difference is JSON's ``\\/`` escape, which Python reads as a backslash and a slash).

    ``ValueError`` naming ``tools`` for a tool or parameter name that is not a Python identifier
    (no call with it could be read back).
    """
    import xgrammar as xgr

    def literal(text: str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

    def argument(key: str, schema):
        value = xgr.Grammar.from_json_schema(json.dumps(schema if isinstance(schema, dict) else {}),
                                             any_whitespace=False)
        return xgr.Grammar.concat(literal(f"{key}="), value)

    def function(tool: dict):
        name, parameters = tool["function"]["name"], tool["function"]["parameters"]
        properties = [(key, schema) for key, schema in (parameters.get("properties") or {}).items()]
        bad = [word for word in [name] + [key for key, _ in properties]
               if not word.isidentifier() or keyword.iskeyword(word)]
        if bad:
            raise ValueError(f"tools: {bad[0]!r} (in tool {name!r}) is not a Python identifier, so the gemma "
                             f"format cannot write a call with it")
        required = set(parameters.get("required") or [])
        # The first argument written has no comma before it: one alternative per possible first
        # argument (any argument up to the first required one), so the size stays quadratic.
        first_required = next((i for i, (key, _) in enumerate(properties) if key in required), len(properties))
        alternatives = [] if first_required < len(properties) else [literal("")]
        for first in range(min(first_required + 1, len(properties))):
            parts = [argument(*properties[first])]
            for key, schema in properties[first + 1:]:
                later = xgr.Grammar.concat(literal(", "), argument(key, schema))
                parts.append(later if key in required else xgr.Grammar.union(later, literal("")))
            alternatives.append(parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts))
        body = alternatives[0] if len(alternatives) == 1 else xgr.Grammar.union(*alternatives)
        return xgr.Grammar.concat(literal(f"```tool_code\n{name}("), body, literal(")\n```"))

    calls = [function(tool) for tool in tools]
    return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
