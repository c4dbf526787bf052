"""`XTML`, the chat template bound to a tokenizer: render to ids with the loss mask, parse, stream, validate."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from k3post.tokenizer import IMAGE_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, decode, encode_text, special_ids
from k3post.xtml.events import Rendered, ValidationResult, XTMLParseError
from k3post.xtml.format import EOM, OPEN, TOOL_DECLARE_DYNAMIC_TEMPLATE, _check_mode
from k3post.xtml.parse import StreamParser, _HeaderError, _Machine, _parse_header
from k3post.xtml.render import _append_generation_prefix, _Binding, _build, _Builder, _render_input, render_text

class XTML:
    """XTML rendering and parsing bound to a tokenizer holding the XTML special tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)  # ids outside [0, vocab_size) are malformed input, not text
        ids = special_ids(tokenizer)
        self.open_id, self.close_id, self.sep_id, self.eom_id = (ids[t] for t in SPECIAL_TOKENS)
        self.pad_id = ids[PAD_TOKEN]
        self.image_id: int | None = ids.get(IMAGE_TOKEN)
        self._ids = ids
        # structure tokens, and the pad where it is an id of its own (an image id is text to the parser)
        self._kind: dict[int, str] = {ids[t]: t for t in SPECIAL_TOKENS}
        if self.pad_id not in self._kind:
            self._kind[self.pad_id] = PAD_TOKEN

    # ------------------------------------------------------------------ rendering
    def _encode(self, b: _Builder) -> Rendered:
        ids: list[int] = []
        midx: list[int] = []
        mask: list[bool] = []
        for p in b.pieces:
            if p.special and p.value not in self._ids:
                raise ValueError(
                    f"message {p.message}: an image content part needs the tokenizer to have the {p.value!r} token "
                    "(k3post.tokenizer.train_tokenizer gives it id 5; add it to a foreign tokenizer as a special token)"
                )
            toks = [self._ids[p.value]] if p.special else encode_text(self.tokenizer, p.value)
            ids.extend(toks)
            midx.extend([p.message] * len(toks))
            mask.extend([p.train] * len(toks))
        return Rendered(ids, midx, mask)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        effort: str | None = None,
        mode: str = "think",
        add_generation_prompt: bool = False,
        tool_choice: Any = None,
        response_format: Any = None,
    ) -> Rendered:
        """Render a conversation to token ids with message indices and the loss mask.

        Args:
            messages: OpenAI chat messages, rendered as the shipped K3 encoder does.
                ``content`` is a string, None or a list of parts (``{"type": "text",
                "text": ...}``; ``image`` / ``image_url`` parts become `IMAGE_TOKEN`);
                system/user/assistant messages may carry ``name``; assistant messages
                carry ``reasoning_content`` (or ``reasoning``; whitespace only renders an
                empty think channel) and ``tool_calls`` (``function.arguments`` a JSON
                string, a dict or None; empty means ``{}``; anything that is not a JSON
                object is written as a loss-masked JSON-fallback block). Tool results
                after an assistant message are numbered 1, 2, ... (``index``); a run of
                results whose ``tool_call_id`` all match that message's calls is first
                sorted into call order and takes the calls' names; otherwise a result's
                name is its ``tool`` / ``name``, else that of the call at its number. A
                system message with a non-empty ``tools`` list announces tools
                mid-session (`is_tool_declaration`). ``developer`` messages render
                nothing (a warning says so).
            tools: OpenAI function specs, declared in a global tool-declare
                message (None or an empty list: no declaration).
            effort: ``"low" | "high" | "max"`` thinking effort (think mode only); None
                means `DEFAULT_EFFORT` in think mode; `OMIT_EFFORT` writes no message.
            mode: ``"think"`` or ``"instruct"``.
            add_generation_prompt: append the generation prefix.
            tool_choice: OpenAI tool_choice (one-shot option).
            response_format: OpenAI response_format (one-shot option).
        """
        b = _build(
            messages,
            tools=tools,
            effort=effort,
            mode=mode,
            add_generation_prompt=add_generation_prompt,
            tool_choice=tool_choice,
            response_format=response_format,
        )
        return self._encode(b)

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        effort: str | None = None,
        mode: str = "think",
        add_generation_prompt: bool = False,
        tool_choice: Any = None,
        response_format: Any = None,
    ) -> str:
        """Same as the module-level `render_text`."""
        return render_text(
            messages,
            tools=tools,
            effort=effort,
            mode=mode,
            add_generation_prompt=add_generation_prompt,
            tool_choice=tool_choice,
            response_format=response_format,
        )

    def generation_prefix(self, mode: str = "think") -> list[int]:
        """Ids of ``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`` (or ``response``)."""
        _check_mode(mode)
        b = _Builder()
        _append_generation_prefix(b, 0, mode)
        return self._encode(b).ids

    # ------------------------------------------------------------------ parsing
    def parse(
        self, ids: Sequence[int], *, mode: str = "think", partial: bool = False, after_prefix: bool = False
    ) -> dict[str, Any]:
        """Parse one assistant message from ids.

        Accepts a full message (with its header), a message body starting at a
        channel header, or a completion sampled after the generation prefix
        (starting inside ``think``, or ``response`` in instruct mode). With
        ``after_prefix=True`` the ids are taken as such a completion only: the
        channel the prefix opened is open, so a first ``<|open|>`` is a nested
        element (an error), exactly as the same tokens parse inside the rendered
        context (`extend`, `annotate`). The trailing ``<|end_of_msg|>`` is
        optional. With ``partial=True`` an unfinished message returns what has
        been parsed.

        Returns:
            ``{"role": "assistant", "reasoning_content": str | None, "content": str,
            "tool_calls": [{"id": "call_<i>", "type": "function",
            "function": {"name": str, "arguments": JSON str}}]}``; a JSON-fallback
            call keeps its raw body as ``arguments``.

        Raises:
            XTMLParseError: naming the first malformed token position.
        """
        m = _Machine(self, context=False, mode=mode, stream=False, after_prefix=after_prefix)
        for t in ids:
            m.feed(int(t))
        m.finish(partial)
        return m.message()

    def stream(self, mode: str = "think") -> StreamParser:
        """A `StreamParser` for a completion sampled after the generation prefix (as
        ``parse(..., after_prefix=True)``: the tokens parse as they will inside the context)."""
        return StreamParser(self, mode)

    def validate(self, ids: Sequence[int], *, mode: str = "think", partial: bool = False) -> ValidationResult:
        """Check ids and report the first malformed token.

        A sequence starting with a ``message`` header is checked as a context
        (any roles; it may end in a generation prefix); anything else as a
        completion (see `parse`). ``partial=True`` accepts a premature end.
        """
        ids = [int(t) for t in ids]
        context = False
        if ids and ids[0] == self.open_id:
            j = 1
            while j < len(ids) and ids[j] not in self._kind and 0 <= ids[j] < self.vocab_size:
                j += 1
            context = re.match(r"message(\s|$)", decode(self.tokenizer, ids[1:j])) is not None
        m = _Machine(self, context=context, mode=mode, stream=False)
        try:
            for t in ids:
                m.feed(t)
            m.finish(partial)
        except XTMLParseError as e:
            return ValidationResult(False, e.position, e.message)
        return ValidationResult(True, None, "ok")

    # ------------------------------------------------------------------ multi-turn
    def _messages_of(self, ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) spans of the messages in ids (split after each <|end_of_msg|>)."""
        spans: list[tuple[int, int]] = []
        start = 0
        for k, t in enumerate(ids):
            if t == self.eom_id:
                spans.append((start, k + 1))
                start = k + 1
        if start < len(ids):
            spans.append((start, len(ids)))
        return spans

    def annotate(self, ids: Sequence[int]) -> Rendered:
        """Recover message indices and the loss mask of a rendered (+ sampled) context.

        Same rules as `render`: option messages get -1 (a mid-session ``tool-declare``,
        told apart by its body, is an input message), assistant tokens after their
        first channel header are trainable, JSON-fallback blocks are not. Messages
        are numbered in the order they appear, which is `render`'s numbering unless
        it dropped a ``developer`` message or re-sorted tool results.
        """
        ids = [int(t) for t in ids]
        bad = next((k for k, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token {bad}: id {ids[bad]} is not a token of the tokenizer (vocabulary size {self.vocab_size})")
        midx: list[int] = []
        mask: list[bool] = []
        count = 0
        seen_input = False
        for s, e in self._messages_of(ids):
            if ids[s] != self.open_id:
                raise ValueError(f"token {s}: expected {OPEN} at the start of a message")
            k = s + 1
            while k < e and ids[k] != self.sep_id:
                k += 1
            try:
                tag, attrs, _ = _parse_header(decode(self.tokenizer, ids[s + 1 : k]))
            except _HeaderError as err:
                raise ValueError(f"token {s}: bad message header: {err.message}") from None
            if tag != "message":
                raise ValueError(f"token {s}: expected a message element, got <{tag}>")
            mtype = attrs.get("type")
            dynamic = mtype == "tool-declare" and decode(self.tokenizer, ids[k + 1 : e]).startswith(
                TOOL_DECLARE_DYNAMIC_TEMPLATE.split("\n", 1)[0]
            )
            if mtype in ("thinking-effort", "tool-choice", "response-format") or (
                mtype == "tool-declare" and not dynamic and not seen_input
            ):
                index = -1
            else:
                index, count, seen_input = count, count + 1, True
            midx.extend([index] * (e - s))
            mmask = [False] * (e - s)
            if attrs.get("role") == "assistant":
                first = k + 1  # first channel header starts here
                j = first
                while j < e and ids[j] != self.sep_id:
                    j += 1
                j += 1
                while j < e:
                    mmask[j - s] = True
                    if ids[j] == self.open_id:
                        h = j + 1
                        while h < e and ids[h] not in self._kind:
                            h += 1
                        if re.match(r"json(\s|$)", decode(self.tokenizer, ids[j + 1 : h])):
                            c = h
                            while c < e and ids[c] != self.close_id:
                                c += 1
                            while c < e and ids[c] != self.sep_id:
                                c += 1
                            for q in range(j, min(c + 1, e)):
                                mmask[q - s] = False
                            j = c + 1
                            continue
                    j += 1
            mask.extend(mmask)
        return Rendered(ids, midx, mask)

    def extend(
        self,
        ids: Sequence[int],
        new_messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        mode: str = "think",
    ) -> Rendered:
        """Append new messages to a context without re-rendering it.

        ``ids`` (prompt + sampled completion ending in ``<|end_of_msg|>``) are kept
        verbatim, even when the sample is not the canonical tokenization; their
        labels come from `annotate`. ``tools`` is shorthand for a leading input
        option message ``{"role": "system", "tools": tools}``.
        Tool results bind to the calls of the last assistant message in ``ids``
        (call ids are ``call_<index>``, as `parse` returns them) and are numbered on
        from the results already there; only the new results are re-sorted.
        New messages get indices continuing those of ``ids``.
        """
        _check_mode(mode)
        ids = [int(t) for t in ids]
        if ids and ids[-1] != self.eom_id:
            raise ValueError(f"ids must end with {EOM} (a finished message) to be extended")
        base = self.annotate(ids)
        spans = self._messages_of(ids)
        start = 1 + max([i for i in base.message_index if i >= 0], default=-1)
        binding = _Binding()
        for s, e in spans:
            k = s + 1
            while k < e and ids[k] not in self._kind:
                k += 1
            try:
                _, attrs, _ = _parse_header(decode(self.tokenizer, ids[s + 1 : k]))
            except _HeaderError:
                continue
            if attrs.get("role") == "assistant":
                try:
                    msg = self.parse(ids[s:e], mode=mode)
                except XTMLParseError:
                    binding.calls, binding.count = None, 0
                    continue
                binding.calls = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
                binding.count = 0
            elif attrs.get("role") == "tool":
                binding.count += 1
        msgs = list(new_messages)
        if tools:
            msgs.insert(0, {"role": "system", "tools": list(tools)})
        b = _Builder()
        _render_input(b, msgs, mode=mode, start_index=start, binding=binding)
        if add_generation_prompt:
            _append_generation_prefix(b, start + len(msgs), mode)
        tail = self._encode(b)
        return Rendered(
            base.ids + tail.ids, base.message_index + tail.message_index, base.loss_mask + tail.loss_mask
        )
