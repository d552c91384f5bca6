"""Template families whose assistant turns have no learned role header to find (issue 38): every agentic
row is stored, its ids equal the template's own rendering of the row as given, and its loss mask equals the
template's {% generation %} blocks (Hugging Face's return_assistant_tokens_mask) on every token.

The templates are written for hsx from the families' behaviour (tests/templates/*.jinja):
- empty_prompt: no generation prompt, the answer follows [/INST] directly (its space is generated);
- tool_outputs: an answer after tool outputs carries no role header;
- think_cut: reasoning inline in the content (<think>...</think>answer), cut from history by the template;
- prompt_differs: the generation prompt (<|assistant|><think>) is not how a finished turn starts;
- string_arguments / text_arguments: string tool-call arguments rendered verbatim as text.
Held-out review (written from each family's behaviour, not from its file):
- gemma_turns (system folded into the first user turn, no tool role, trimmed), llama_system_tools (tools in
  the system header, one call a turn, ipython results), phi4_sep (<|im_sep|>), command_turns (Command-R-like,
  tool results a system-like turn), hermes_calls (<tool_call> in ChatML, results in a user turn),
  granite_roles, think_final_only (<think> on the last turn only), bos_post (BOS in the template and from the
  tokenizer's post-processor), kimi_sections, fullwidth_outputs (DeepSeek-V3.1-like, multi-byte special
  tokens), plain_roles (no special token but the EOS);
- glm_observation: no end-of-turn token, the next role marker (<|user|>, <|observation|>) ends the turn;
- phi3_eos: an EOS after the conversation whose text shares "<|" with the next turn's marker;
- glm_functions: older GLM-like, no end-of-turn token, each call its own <|assistant|>NAME\nARGS;
- escaped_html: texts HTML-escaped, the last assistant turn left open (no end marker when it ends the text);
- recipient_prompt (a generation prompt ending in the >>> the model's recipient follows), tool_args_marker
  (Devstral-like [TOOL_CALLS]NAME[ARGS]ARGS, no generation prompt), role_tokens_m2 (MiniMax-M2-like);
- reminder_prompt: the generation prompt puts a reminder turn before the header, finished turns never do.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from hsx.prep.rows import RowRejected, read_conversation
from hsx.prep.tokenise import ChatTokeniser, TemplateError
from hsx_tools.demo import sample_dataset
from hsx_tools.samples import agentic_rows
from hsx_tools.tinymodel import build_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
ROWS = 48
MISTRAL_SPECIAL = ("<s>", "</s>", "[INST]", "[/INST]", "[THINK]", "[/THINK]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
OUTPUTS_SPECIAL = ("<|bos|>", "<|User|>", "<|Assistant|>", "<|outputs_begin|>", "<|outputs_end|>", "<|output|>",
                   "<|/output|>", "<|calls|>", "<|/calls|>", "<|call|>", "<|/call|>", "<|eos|>")
R1_SPECIAL = ("<|bos|>", "<|User|>", "<|Assistant|>", "<|tool|>", "<|/tool|>", "<|call|>", "<|/call|>", "<|eos|>")
DIFFERS_SPECIAL = ("<|system|>", "<|user|>", "<|tool|>", "<|assistant|>", "<|end|>", "<|calls|>")


def _inline_reasoning(row):
    """Reasoning written inline at the start of the content, as R1-style datasets hold it."""
    if "messages" not in row:
        return row
    out = []
    for msg in row["messages"]:
        msg = dict(msg)
        if msg.get("reasoning_content", "").strip():
            msg["content"] = ("<think>\n" + msg.pop("reasoning_content").strip() + "\n</think>\n\n"
                              + (msg.get("content") or "").lstrip())
        out.append(msg)
    return {**row, "messages": out}


def _serialised_arguments(row):
    """String arguments as serving stacks send them: compact separators, non-ASCII escaped or not."""
    if "messages" not in row:
        return row
    out, n = [], 0
    for msg in row["messages"]:
        msg = dict(msg)
        calls = []
        for call in msg.get("tool_calls") or []:
            args = call["function"]["arguments"]
            if isinstance(args, str):
                value = json.loads(args)
                for key in ("city", "query"):
                    if key in value:
                        value[key] = "東京 " + value[key]
                n += 1
                args = json.dumps(value, separators=(",", ":")) if n % 2 else json.dumps(value, ensure_ascii=False)
            calls.append({**call, "function": {**call["function"], "arguments": args}})
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return {**row, "messages": out}


GEMMA_SPECIAL = ("<bos>", "<start_of_turn>", "<end_of_turn>")
LLAMA_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
PHI4_SPECIAL = ("<|im_sep|>", "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>")
COMMAND_SPECIAL = ("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
                   "<|CHATBOT_TOKEN|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
                   "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>")
GLM_SPECIAL = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<tool_call>",
               "</tool_call>")
GRANITE_SPECIAL = ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>")
ZEPHYR_SPECIAL = ("<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>")
KIMI_SPECIAL = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
                "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
FULLWIDTH_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁calls▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
PHI3_SPECIAL = ("<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>")
DEVSTRAL_SPECIAL = MISTRAL_SPECIAL + ("[ARGS]",)
M2_SPECIAL = ("]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>")

# family -> (template file, special tokens, bos, row transform, arguments: "object" | "text" | "text only", eos)
FAMILIES = {
    "empty_prompt": ("empty_prompt.jinja", MISTRAL_SPECIAL, "<s>", None, "object", "<|im_end|>"),
    "tool_outputs": ("tool_outputs.jinja", OUTPUTS_SPECIAL, "<|bos|>", None, "object", "<|im_end|>"),
    "think_cut": ("think_cut.jinja", R1_SPECIAL, "<|bos|>", _inline_reasoning, "object", "<|im_end|>"),
    "prompt_differs": ("prompt_differs.jinja", DIFFERS_SPECIAL, None, None, "object", "<|im_end|>"),
    "string_arguments": ("string_arguments.jinja", (), None, _serialised_arguments, "text", "<|im_end|>"),
    "text_arguments": ("text_arguments.jinja", (), "<|endoftext|>", _serialised_arguments, "text only", "<|im_end|>"),
    "gemma_turns": ("gemma_turns.jinja", GEMMA_SPECIAL, "<bos>", None, "object", "<end_of_turn>"),
    "llama_system_tools": ("llama_system_tools.jinja", LLAMA_SPECIAL, "<|begin_of_text|>", None, "object", "<|eot_id|>"),
    "phi4_sep": ("phi4_sep.jinja", PHI4_SPECIAL, None, None, "object", "<|im_end|>"),
    "command_turns": ("command_turns.jinja", COMMAND_SPECIAL, "<BOS_TOKEN>", None, "object", "<|END_OF_TURN_TOKEN|>"),
    "glm_observation": ("glm_observation.jinja", GLM_SPECIAL, None, None, "object", "<|user|>"),
    "hermes_calls": ("hermes_calls.jinja", (), None, _serialised_arguments, "text", "<|im_end|>"),
    "granite_roles": ("granite_roles.jinja", GRANITE_SPECIAL, None, None, "object", "<|end_of_text|>"),
    "think_final_only": ("think_final_only.jinja", (), None, None, "object", "<|im_end|>"),
    "bos_post": ("bos_post.jinja", ZEPHYR_SPECIAL, "<s>", None, "object", "</s>"),
    "kimi_sections": ("kimi_sections.jinja", KIMI_SPECIAL, None, _serialised_arguments, "text", "<|im_end|>"),
    "fullwidth_outputs": ("fullwidth_outputs.jinja", FULLWIDTH_SPECIAL, "<｜begin▁of▁sentence｜>", _serialised_arguments,
                          "text only", "<｜end▁of▁sentence｜>"),
    "plain_roles": ("plain_roles.jinja", (), None, None, "object", "</s>"),
    "phi3_eos": ("phi3_eos.jinja", PHI3_SPECIAL, None, None, "object", "<|endoftext|>"),
    "glm_functions": ("glm_functions.jinja", GLM_SPECIAL, None, None, "object", "<|user|>"),
    "escaped_html": ("escaped_html.jinja", (), None, _inline_reasoning, "object", "<|im_end|>"),
    "recipient_prompt": ("recipient_prompt.jinja", LLAMA_SPECIAL, None, None, "object", "<|eot_id|>"),
    "tool_args_marker": ("tool_args_marker.jinja", DEVSTRAL_SPECIAL, "<s>", _serialised_arguments, "text", "</s>"),
    "role_tokens_m2": ("role_tokens_m2.jinja", M2_SPECIAL, None, None, "object", "[e~["),
    "reminder_prompt": ("reminder_prompt.jinja", (), None, None, "object", "<|im_end|>"),
}
REFUSED_BY_TEMPLATE = {"llama_system_tools": 30}    # rows with several calls in a turn: the template raises


def _bos_from_post_processor(tok, bos):
    """The tokenizer adds the BOS itself with add_special_tokens (Llama / Gemma tokenizers); the template too."""
    from tokenizers import processors
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    assert tok("x")["input_ids"][0] == tok.convert_tokens_to_ids(bos)


def _as_given(row, messages, arguments):
    """The normal form with every tool call's arguments as the row gives them: a string verbatim where the
    template takes text, parsed where it needs an object; an object as JSON text where it takes text only."""
    raw = row.get("messages")
    for k, msg in enumerate(messages):
        for j, call in enumerate(msg.get("tool_calls", [])):
            given = raw[k]["tool_calls"][j]["function"]["arguments"] if raw is not None else call["function"]["arguments"]
            if arguments == "object" and isinstance(given, str):
                given = json.loads(given)
            elif arguments == "text only" and not isinstance(given, str):
                given = json.dumps(given, ensure_ascii=False)
            call["function"]["arguments"] = given
        if arguments == "text only" and "reasoning_content" in msg:      # text_arguments reads message.thinking
            msg["thinking"] = msg.pop("reasoning_content")
    return messages


def family_tokenizer(name: str, folder):
    """The tokenizer of family ``name`` with its test template (FAMILIES), built in ``folder``."""
    template, special, bos, transform, arguments, eos = FAMILIES[name]
    tok = build_tokenizer(folder, chat_template=(TEMPLATES / template).read_text(), special_tokens=special,
                          bos_token=bos, eos_token=eos, sample_path=sample_dataset())
    if name == "bos_post":
        _bos_from_post_processor(tok, bos)
    return tok


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_agentic_row_stored_with_exact_ids_and_mask(name, tmp_path):
    template, special, bos, transform, arguments, eos = FAMILIES[name]
    tok = family_tokenizer(name, tmp_path)
    chat = ChatTokeniser(tok)
    rows = [transform(r) if transform else r for r in agentic_rows(ROWS, seed=23)]
    rejected, wrong_ids, wrong_masks, masked, refused = [], [], [], 0, 0
    for index, row in enumerate(rows):
        conv = read_conversation(row)
        messages = [{**m, "content": m["content"] or ""} for m in conv.messages]   # a null content: ""
        try:
            want = tok.apply_chat_template(_as_given(row, messages, arguments), tools=conv.tools, tokenize=True,
                                           return_dict=True, return_assistant_tokens_mask=True)
        except Exception:   # the template itself refuses the row (raise_exception): hsx must refuse it too
            want = None
        try:
            got = chat.encode_row(row, index)
        except RowRejected as exc:
            if want is None and exc.reason == "template_error":
                refused += 1
            else:
                rejected.append(f"{row['id']}: {exc}")
            continue
        if want is None:
            rejected.append(f"{row['id']}: stored, yet the template refuses it")
            continue
        if got.input_ids.tolist() != list(want["input_ids"]):
            wrong_ids.append(row["id"])
        elif got.loss_mask.tolist() != list(want["assistant_masks"]):
            wrong_masks.append((row["id"], int(np.sum(got.loss_mask != np.asarray(want["assistant_masks"])))))
        masked += int(got.loss_mask.sum())
    print(f"{name}: {ROWS - len(rejected) - refused}/{ROWS} stored ({refused} refused by the template), "
          f"{len(wrong_ids)} wrong ids, {len(wrong_masks)} wrong masks {wrong_masks[:3]}; {chat.locating}")
    assert not rejected, f"{len(rejected)}/{ROWS} rejected, e.g. {rejected[:2]}"
    assert refused == REFUSED_BY_TEMPLATE.get(name, 0), f"{refused} rows refused by the template"
    assert not wrong_ids, f"{len(wrong_ids)} rows with ids unlike the template's rendering, e.g. {wrong_ids[:3]}"
    assert not wrong_masks, f"{len(wrong_masks)} masks unlike the generation blocks (row, tokens): {wrong_masks[:3]}"
    assert masked > (ROWS - refused) * 20


def test_a_row_that_cannot_be_located_is_quoted_with_the_text_around_the_place(tmp_path):
    """The rejection names the turn and quotes the real rendering around where it stops lining up, control
    characters escaped (one printable line for hsx inspect's examples and the producer's report)."""
    template = ("{%- if messages[-1].content.startswith('Sure') -%}{{- 'Be sure.\\n\\t' -}}{%- endif -%}"
                "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    chat = ChatTokeniser(build_tokenizer(tmp_path, chat_template=template))
    with pytest.raises(RowRejected) as caught:
        chat.encode_row({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure."}]}, 0)
    message = str(caught.value)
    assert caught.value.reason == "turn_not_located" and message.startswith("turn 1 (assistant)")
    assert message.endswith("near: |>Be sure.\\n\\t<|im_start|>user\\nhi<|im_end|>\\n<|im_sta...")
    assert message.isprintable()


NULL_CONTENT = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}{%- generation -%}"
    "{%- if m.content is defined -%}{{- m.content + '\\n<|text_end|>' -}}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}{{- '\\n<tool_call>' + c.function | tojson + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}{%- endgeneration -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_a_call_turn_given_without_content_reaches_a_template_that_tells_it_from_empty(tmp_path):
    """Hugging Face drops a null content's key; a template that tests for it renders such a call turn otherwise
    than one with "" (DeepSeek style). The row as given is what the template renders: on main hsx wrote ""."""
    tok = build_tokenizer(tmp_path, chat_template=NULL_CONTENT, special_tokens=("<|text_end|>",),
                          sample_path=sample_dataset())
    chat = ChatTokeniser(tok)
    assert "null content passed as None" in chat.locating
    nulls = 0
    for index, row in enumerate(agentic_rows(24, seed=29, sharegpt_every=10**6)):
        got = chat.encode_row(row, index)
        messages = read_conversation(row).messages
        for msg, given in zip(messages, row["messages"], strict=True):
            if msg["role"] == "assistant" and given.get("content") is None:
                msg["content"] = None
                nulls += 1
            for call in msg.get("tool_calls", []):
                if isinstance(call["function"]["arguments"], str):
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        want = tok.apply_chat_template(messages, tools=row.get("tools"), tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        assert got.input_ids.tolist() == list(want["input_ids"]), row["id"]
        assert got.loss_mask.tolist() == list(want["assistant_masks"]), row["id"]
    assert nulls >= 10


def test_a_template_ignoring_the_generation_prompt_is_refused_in_one_line(tmp_path):
    """A ChatML template that never renders the generation prompt yet opens every finished answer with
    <|im_start|>assistant\\n: whether the model writes that header is undefined, so no mask is. On main the
    template was taken and 6 of 48 agentic rows stored with that header inside the mask. A template with no
    end-of-turn marker whose next turn opens with no special token is refused too (where does the turn end?)."""
    tok = build_tokenizer(tmp_path / "a", chat_template=(TEMPLATES / "no_prompt.jinja").read_text())
    with pytest.raises(TemplateError) as caught:
        ChatTokeniser(tok)
    message = str(caught.value)
    assert message.startswith("the chat template ignores add_generation_prompt, yet a finished answer opens with "
                              "'<|im_start|>assistant\\n'") and message.isprintable()
    plain = ("{%- for m in messages -%}{{- m.role + ': ' + (m.content or '') + '\\n' -}}{%- endfor -%}"
             "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")
    with pytest.raises(TemplateError, match="renders nothing after an assistant turn and the next turn opens with no special token"):
        ChatTokeniser(build_tokenizer(tmp_path / "b", chat_template=plain))


def _assistant_parts(row):
    """Each assistant content as two text parts, split at its first space (the template trims each)."""
    if "messages" not in row:
        return row
    out = []
    for msg in row["messages"]:
        if msg["role"] == "assistant" and isinstance(msg.get("content"), str) and " " in msg["content"].strip():
            head, rest = msg["content"].split(" ", 1)
            msg = {**msg, "content": [{"type": "text", "text": head + " "}, {"type": "text", "text": rest}]}
        out.append(msg)
    return {**row, "messages": out}


@pytest.mark.parametrize("transform", [None, _assistant_parts])
def test_text_parts_reach_a_template_that_renders_parts_as_given(transform, tmp_path):
    """A Llama-4-like template writes a string as is and trims each text part: a tool result the row gives as
    [{"type": "text", "text": "...\\n"}] renders without its newline, an answer in two parts without the space
    between them. The ids equal the template's rendering of the row as given (its parts), the mask its
    generation blocks; on main hsx joined the parts first: 3 of 48 rows with wrong ids (tool results in parts),
    36 of 48 with the answers in parts too."""
    tok = build_tokenizer(tmp_path, chat_template=(TEMPLATES / "parts_trimmed.jinja").read_text(),
                          special_tokens=("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>"),
                          bos_token="<|begin_of_text|>", eos_token="<|eot|>", sample_path=sample_dataset())
    chat = ChatTokeniser(tok)
    assert "text parts passed as given" in chat.locating
    given = 0
    for index, row in enumerate(agentic_rows(ROWS, seed=23)):
        row = transform(row) if transform else row
        got = chat.encode_row(row, index)
        conv = read_conversation(row)
        messages = _as_given(row, [{**m, "content": m["content"] or ""} for m in conv.messages], "object")
        for msg, raw in zip(messages, row.get("messages", []), strict=False):
            if isinstance(raw.get("content"), list):
                msg["content"] = raw["content"]
                given += 1
        want = tok.apply_chat_template(messages, tools=conv.tools, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        assert got.input_ids.tolist() == list(want["input_ids"]), row["id"]
        assert got.loss_mask.tolist() == list(want["assistant_masks"]), row["id"]
    assert given >= 20


WRITE_TOOL = [{"type": "function", "function": {"name": "write", "description": "write a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}}}]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_end_marker_written_in_a_later_tool_argument_does_not_end_the_turn(name, tmp_path):
    """A coding agent writes a file holding its own template's end-of-turn text. Only the first string argument
    was marked, and the turn's end was looked for after its last marker: it stopped inside the second argument,
    the rest of the call and the real end out of the mask, in any turn (the outside check of the tenth session:
    llama, XML-tool and Qwen3-XML style templates)."""
    template, special, bos, transform, arguments, eos = FAMILIES[name]
    tok = family_tokenizer(name, tmp_path)
    text = f"line{eos}\nx<|eot_id|>y<|im_end|>\nz<|user|>w"
    row = {"id": "eot", "tools": WRITE_TOOL, "messages": [
        {"role": "user", "content": "write the file"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "write", "arguments": {"path": "a.txt", "text": text}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "write", "content": "ok"},
        {"role": "assistant", "content": "written"}]}
    row = transform(row) if transform else row
    conv = read_conversation(row)
    messages = [{**m, "content": m["content"] or ""} for m in conv.messages]
    want = tok.apply_chat_template(_as_given(row, messages, arguments), tools=conv.tools, tokenize=True,
                                   return_dict=True, return_assistant_tokens_mask=True)
    got = ChatTokeniser(tok).encode_row(row, 0)
    assert got.input_ids.tolist() == list(want["input_ids"])
    assert got.loss_mask.tolist() == list(want["assistant_masks"]), tok.decode(
        [t for t, m in zip(got.input_ids.tolist(), got.loss_mask.tolist(), strict=True) if m])


NO_END_MARKER = {"glm_functions", "glm_observation"}   # the next turn's opening token is the turn's end (docs/data.md)


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - NO_END_MARKER))
def test_consecutive_assistant_messages_mask_no_role_header(name, tmp_path):
    """Under a template that leaves the last turn open (no end marker after it), the second of two assistant
    messages in a row had its role header masked, its span overlapping the first's (the outside check of the
    tenth session: escaped_html). A template with no end marker masks the next turn's opening token as the
    turn's end, as documented, so it differs from the generation blocks here by design."""
    template, special, bos, transform, arguments, eos = FAMILIES[name]
    tok = family_tokenizer(name, tmp_path)
    row = {"id": "two", "messages": [{"role": "user", "content": "say two things"},
                                     {"role": "assistant", "content": "first thing"},
                                     {"role": "assistant", "content": "second thing"}]}
    row = transform(row) if transform else row
    conv = read_conversation(row)
    messages = [{**m, "content": m["content"] or ""} for m in conv.messages]
    try:
        want = tok.apply_chat_template(_as_given(row, messages, arguments), tools=conv.tools, tokenize=True,
                                       return_dict=True, return_assistant_tokens_mask=True)
    except Exception:   # the template refuses roles that do not alternate: hsx must refuse the row too
        with pytest.raises(RowRejected, match="template"):
            ChatTokeniser(tok).encode_row(row, 0)
        return
    got = ChatTokeniser(tok).encode_row(row, 0)
    assert got.input_ids.tolist() == list(want["input_ids"])
    assert got.loss_mask.tolist() == list(want["assistant_masks"]), tok.decode(
        [t for t, m in zip(got.input_ids.tolist(), got.loss_mask.tolist(), strict=True) if m])
