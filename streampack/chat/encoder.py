"""Chat records -> tokens and a loss mask: rendered with the tokenizer's own chat template, supervised on the turns
the user names.

Rendering is transformers' (the jinja renderer ``apply_chat_template`` runs, with the tokenizer's special tokens),
and the rendered text is tokenized as ``apply_chat_template`` does (``add_special_tokens=False``), so ids equal it.
A token is supervised when its characters overlap a supervised span (the rule of ``return_assistant_tokens_mask``):

- a template with ``{% generation %}`` markers gives the assistant spans itself, so the mask is exactly
  ``return_assistant_tokens_mask``'s;
- otherwise each turn's span is found from the rendering: turn ``i`` starts where the rendering of
  ``messages[:i]`` ends (for an assistant turn after the generation prompt, or the part of it the turn renders:
  the header, and a ``<think>`` the prompt opens, are prompt) and ends where the rendering of
  ``messages[:i + 1]`` ends, less its trailing whitespace (the separator before the next turn). A rendering that
  is not a prefix of the whole counts up to where the two part in whole tokens, and only when the turn's content
  came before that point (phi-3 writes EOS only after the last turn); otherwise the template rewrites earlier
  turns (one that drops past reasoning) and the record is refused (``chat_template_rewrites``), never
  mis-masked; the final turn is always checkable (``train_on="last"``). A turn whose role renders nothing is
  ``chat_role_unplaced``; a template that raises on the conversation, or on a prefix a trained turn is read
  from, is ``chat_template_error``.

``prompt`` / ``completion`` records follow TRL: strings are tokenized as text (EOS appended unless the completion
ends with it), message lists are rendered; the completion starts where the ids of the prompt alone and of the
whole diverge. Cost: rendering a conversation of ``n`` turns renders ``n`` prefixes (``benchmarks/bench_chat.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from streampack.chat.records import Conversation, conversation
from streampack.chat.template import Rendered, Template, common_prefix, message_text, renders_content
from streampack.errors import DataError
from streampack.io.limits import id_bound
from streampack.options.tokenize import ChatOptions
from streampack.sample import Sample


class ChatEncoder:
    """Chat samples -> tokenized samples with ``loss_mask``; the :class:`~streampack.nodes.tokenize.Tokenize` node's
    encoder when ``TokenizeOptions.chat`` is set. ``encode(block)`` returns per sample the result, None (dropped as
    overlong) or the :class:`DataError`; ``events`` counts the last block's ``truncated`` / ``dropped``."""

    COUNTERS = ("truncated", "dropped")

    def __init__(self, tokenizer: Any, options: ChatOptions, *, vocab_size: int | None = None,
                 max_len: int | None = None, media: Any = None) -> None:
        self.template = Template(tokenizer, options.template)
        self.tokenizer = self.template.tokenizer
        self.options, self.vocab_size, self.media = options, vocab_size, media
        self.max_len = None if options.overlong == "policy" else max_len
        self.events = dict.fromkeys(self.COUNTERS, 0)

    def __call__(self, sample: Sample) -> Sample:
        out = self.encode([sample])[0]
        if isinstance(out, DataError):
            raise out
        if out is None:
            raise DataError("chat_overlong", f"the conversation is longer than {self.max_len} tokens",
                            url=sample.url, key=sample.key, value=self.max_len)
        return out

    def encode(self, samples: Sequence[Sample]) -> list[Sample | DataError | None]:
        """Chat samples are rendered and tokenized as one batch; any other sample passes."""
        self.events = dict.fromkeys(self.COUNTERS, 0)
        out: list[Sample | DataError | None] = list(samples)
        todo: list[tuple[int, Rendered]] = []
        for i, s in enumerate(samples):
            if s.chat is None:
                if s.tokens is None:
                    out[i] = DataError("not_chat", "a text sample reached the chat stage: chat= renders chat records "
                                       "(messages, conversations, prompt/completion)", url=s.url, key=s.key,
                                       value=None)
                continue
            try:
                todo.append((i, self._render(s)))
            except DataError as e:
                out[i] = e
        texts = [r for _, r in todo if r.ids is None]
        if texts:  # the fast tokenizer's own batch call, as apply_chat_template tokenizes (no special tokens added)
            for r, e in zip(texts, self.tokenizer.backend_tokenizer.encode_batch([r.text for r in texts],
                                                                                 add_special_tokens=False)):
                r.tokenized(e.ids, e.offsets)
        for i, r in todo:
            try:
                out[i] = self._finish(samples[i], r)
            except DataError as e:  # an image header the media rule refuses
                out[i] = e
        return out

    def _render(self, sample: Sample) -> Rendered:
        conv = conversation(sample.chat, self.options.image_placeholder, url=sample.url, key=sample.key)
        if conv.text_pair is None:
            return self._turns(conv, sample)
        prompt, completion = conv.text_pair
        eos = self.tokenizer.eos_token
        if eos and not completion.endswith(eos):  # TRL: a plain completion learns to stop
            completion += eos
        # TRL: both tokenized with the tokenizer's own special tokens; the completion starts where they diverge
        before, ids = self.tokenizer([prompt, prompt + completion])["input_ids"]
        mask = np.ones(len(ids), dtype=bool)
        mask[:common_prefix(before, ids) if self.options.completion_only else 0] = False
        return Rendered(text=prompt + completion, ids=np.asarray(ids, np.int64), mask=mask)

    def _turns(self, conv: Conversation, sample: Sample) -> Rendered:
        messages, opts = list(conv.messages), self.options
        n = len(messages)
        # a template may refuse a prefix (a lone system turn: "no user query"); only the renderings a trained turn
        # reads must exist
        plain = self.template.render_all([messages[:i] for i in range(1, n + 1)], conv, sample, partial=True)
        full = plain[-1]
        assert full is not None
        for i in range(n):
            if plain[i] is not None and plain[i] == (plain[i - 1] if i else ""):
                raise DataError("chat_role_unplaced", f"the chat template renders nothing for turn {i} (role "
                                f"{messages[i]['role']!r}): it cannot place that role", url=sample.url,
                                key=sample.key, value=messages[i]["role"])
        if conv.prompt_turns is not None:  # TRL's conversational prompt-completion: the completion's turns
            chosen = list(range(conv.prompt_turns if opts.completion_only else 0, n))
        else:
            chosen = [i for i, m in enumerate(messages) if m["role"] in opts.roles]
            if opts.train_on == "last":
                chosen = [i for i in chosen if messages[i]["role"] == "assistant"][-1:]
        if not chosen:
            raise DataError("chat_nothing_supervised", f"no turn of the roles {opts.roles} to supervise",
                            url=sample.url, key=sample.key, value=opts.roles)
        marked = self.template.marked(conv, sample) if self.template.markers and conv.prompt_turns is None else {}
        assistant = [i for i in chosen if messages[i]["role"] == "assistant" and i not in marked]
        gen = dict(zip(assistant, self.template.render_all([messages[:i] for i in assistant], conv, sample, generation=True)))
        spans, cuts = [], []
        for i in chosen:
            if plain[i] is None or (i and plain[i - 1] is None):
                raise DataError("chat_template_error", f"the chat template refuses the conversation up to turn {i} "
                                f"(role {messages[i]['role']!r}), so where that turn ends cannot be read",
                                url=sample.url, key=sample.key, value=i)
            if i in marked:  # the template's own span: no prefix to check
                a, b = marked[i]
            else:
                a, b = self._span(i, messages[i], plain, gen.get(i), full, sample)
                if conv.prompt_turns is None:  # the separator after the end-of-turn token is the next turn's
                    b = a + len(full[a:b].rstrip())  # (as templates with generation markers mark it)
            spans.append((a, self._content_end(full, a, b, messages[i], sample)))
            cuts.append(b)
        return Rendered(text=full, spans=spans, cuts=cuts)

    def _span(self, i: int, message: dict[str, Any], plain: list[str], gen: str | None, full: str,
              sample: Sample) -> tuple[int, int]:
        """Where turn ``i`` starts and ends in ``full``, from the renderings of its prefixes (``gen``: with the
        generation prompt); ``chat_template_rewrites`` when they cannot tell."""
        prev = plain[i - 1] if i else ""
        history = self.template.parting(prev, full)  # a template may end a conversation with EOS: not the next turn's
        if gen is None:
            a = len(prev) if history == len(prev) else -1
        else:  # after the generation prompt, or the part of it the turn renders (one that opens a thinking block)
            a = self.template.parting(gen, full)
            a = a if a > history or gen == prev else -1  # none of a non-empty prompt: the header is unknown
        b = self.template.parting(plain[i], full)
        if a < 0 or b < len(plain[i]) and not renders_content(full, a, b, message):
            raise DataError("chat_template_rewrites", f"the chat template renders turn {i} (role "
                            f"{message['role']!r}) differently once later turns follow (it rewrites earlier turns, "
                            f"e.g. drops past reasoning); train_on='last' supervises only the final turn",
                            url=sample.url, key=sample.key, value=i)
        return a, b

    def _content_end(self, full: str, start: int, end: int, message: dict[str, Any], sample: Sample) -> int:
        """``end`` (the turn's end-of-turn text supervised), or where its content ends when ``train_on_eot`` is
        False."""
        if self.options.train_on_eot:
            return end
        text = message_text(message)
        at = full.rfind(text.rstrip(), start, end) if text.strip() else -1
        if at < 0:
            raise DataError("chat_template_rewrites", f"the template does not render the content of a "
                            f"{message['role']!r} turn verbatim, so its end-of-turn text cannot be told apart "
                            f"(train_on_eot=False)", url=sample.url, key=sample.key, value=message["role"])
        return at + len(text.rstrip())

    def _finish(self, sample: Sample, r: Rendered) -> Sample | DataError | None:
        ids, mask = r.ids, r.mask
        assert ids is not None and mask is not None
        if ids.size and int(ids.max()) >= id_bound(self.vocab_size):
            return DataError("out_of_vocab_id", f"the tokenizer returned token id {int(ids.max())}, not below "
                             f"vocab_size={self.vocab_size}", url=sample.url, key=sample.key, value=int(ids.max()))
        if not mask.any():
            return DataError("chat_nothing_supervised", "no token of the supervised turns survived tokenizing",
                             url=sample.url, key=sample.key, value=None)
        images = sample.images
        if self.max_len is not None and self._length(ids, images) > self.max_len:
            fit = [c for c in r.cut_tokens if self._length(ids[:c], images) <= self.max_len]
            video = any(hasattr(m, "frames") for m in images)  # frames are not cut with the text: kept or dropped
            if self.options.overlong == "drop" or not fit or video:
                self.events["dropped"] += 1
                return None
            ids, mask = ids[:max(fit)], mask[:max(fit)]
            if self.media is not None:
                images = images[:int((ids == self.media.image_token_id).sum())]
            self.events["truncated"] += 1
        return replace(sample, tokens=ids, loss_mask=mask, chat=None, text=None, images=images)

    def _length(self, ids: np.ndarray, images: tuple[Any, ...]) -> int:
        """Tokens once the media rule expands each image placeholder (the packing length)."""
        if self.media is None or not images:
            return int(ids.shape[0])
        from streampack.media.stage import media_counts

        counts, videos = media_counts(Sample(key="", tokens=ids, images=images), self.media)
        placed = int((ids == self.media.image_token_id).sum())
        return int(ids.shape[0]) + sum(counts[:placed]) - placed + sum(videos)


