"""The model's tokenizer at the coordinator: text prompts and chat messages become token ids
here, so both fronts send workers token ids and validate lengths before any worker is busy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from common.errors import InvalidRequest
from coordinator.constants import SPAN_CONTEXT_TOKENS

log = logging.getLogger(__name__)


class PromptTokenizer:
    """Loads the tokenizer of the model folder the workers serve (`load`, blocking: call it
    in a thread), or of the model the first worker registered with (`load_from`). Without
    either it refuses text and chat prompts."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._tokenizer: Any = None
        self._loading: asyncio.Task[None] | None = None

    def load(self) -> None:
        if not self._model:
            return
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self._model)

    def load_from(self, model: str) -> None:
        """The tokenizer of ``model``, for a coordinator started without one (the model its
        workers registered with). Blocking: call it in a thread."""
        self._model = model
        self.load()

    def start_loading(self, model: str) -> None:
        """`load_from` in a thread, in a task of its own (call it from the event loop): the
        first call starts it, later ones do nothing. A request with a text prompt waits for
        it (`ready`); a registration does not."""
        if self._loading is not None or self._tokenizer is not None or not model:
            return
        self._loading = asyncio.get_running_loop().create_task(self._load_logged(model))

    async def _load_logged(self, model: str) -> None:
        try:
            await asyncio.to_thread(self.load_from, model)
            log.info("tokenizer of %s loaded (the model the workers registered)", model)
        except Exception as exc:  # a hub id this host cannot reach: token ids still work
            log.warning("could not load the tokenizer of %s: %s", model, exc)

    async def ready(self) -> None:
        """Returns once a load `start_loading` began has ended (at once if none did)."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    @property
    def vocab_size(self) -> int | None:
        return len(self._tokenizer) if self._tokenizer is not None else None

    def _require(self, what: str) -> Any:
        if self._tokenizer is None:
            raise InvalidRequest(
                f"this coordinator has no tokenizer (--model) for {what}; send prompt_token_ids"
            )
        return self._tokenizer

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._require("text prompts").encode(text))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
        """The model's chat template over ``messages``, ready for the assistant's turn."""
        tokenizer = self._require("chat messages")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("the model has no chat template; use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # a template raising on odd roles or content
            raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
        # The template already holds any special tokens the model wants at the start.
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._require("text output").decode(list(token_ids)))

    def whole_decoder(self, prompt_ids: Sequence[int]) -> Callable[[list[int]], str | None]:
        """Decodes a whole output of ``prompt_ids`` at once (None without a tokenizer)."""
        return lambda output_ids: self.span(prompt_ids, output_ids, 0, len(output_ids))

    def candidate_texts(
        self, prompt_ids: Sequence[int]
    ) -> Callable[[Sequence[int], int, Sequence[int]], list[str] | None]:
        """For a logprobs answer (openai_logprobs.py): given the output, an index i and
        candidate tokens, the text each would add at i after ``output[:i]`` (None without a
        tokenizer). Decoded in context as `span` is, special tokens by their names."""

        def texts(output_ids: Sequence[int], index: int, candidates: Sequence[int]) -> Any:
            if self._tokenizer is None:
                return None
            before = [*prompt_ids, *output_ids[:index]][-SPAN_CONTEXT_TOKENS:]
            prefix = self._tokenizer.decode(before)
            out = []
            for candidate in candidates:
                whole = self._tokenizer.decode([*before, candidate])
                alone = whole[len(prefix) :] if whole.startswith(prefix) else None
                out.append(str(alone if alone is not None else self._tokenizer.decode([candidate])))
            return out

        return texts

    def span(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], start: int, end: int
    ) -> str | None:
        """The text output tokens ``start``..``end`` add after the tokens before them (None
        without a tokenizer). Decoded after a few tokens of context, not alone: a token's
        leading space, or a character split over two tokens, depends on what precedes it."""
        if self._tokenizer is None:
            return None
        if end <= start:
            return ""
        before = [*prompt_ids, *output_ids[:start]][-SPAN_CONTEXT_TOKENS:]
        span = list(output_ids[start:end])
        prefix = self._tokenizer.decode(before, skip_special_tokens=True)
        whole = self._tokenizer.decode(before + span, skip_special_tokens=True)
        if whole.startswith(prefix):
            return str(whole[len(prefix) :])
        return str(self._tokenizer.decode(span, skip_special_tokens=True))
