"""
The tokenizer and the chat template of a Hugging Face model directory: a fast tokenizer (tokenizer.json, read by the
`tokenizers` library), the end-of-turn ids from config.json, generation_config.json and tokenizer_config.json, and the
model's own Jinja chat template rendered the way transformers' apply_chat_template renders it.

Thinking models (DeepSeek-R1 distills, Qwen3) write their reasoning between <think> and </think>, then the answer.
Their templates differ: R1's generation prompt opens <think> itself and has no switch; Qwen3's takes enable_thinking
(false writes an empty <think></think> into the prompt, so the model answers at once). `thinking` sets the switch
(None: the template's default), and Tokenizer.thought splits a generated answer where its thinking ends.

Left out: slow (sentencepiece) tokenizers, tool calls, and templates that need more than messages, bos_token,
eos_token and enable_thinking.
"""

import json
import os
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from config import ModelConfig, ModelError, read_json, token_ids

THINK, END_THINK = "<think>", "</think>"  # the markers of both families (tokens of their own in their vocabularies)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that spells each byte. The bytes that print (! to ~,
    ¡ to ¬, ® to ÿ) spell themselves; the other 68 take the characters from U+0100 on, in byte order."""
    prints = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in prints else chr(next(extra)) for b in range(256)]


BYTE_CHARS = byte_chars()  # e.g. BYTE_CHARS[32] == "Ġ" (a space)
BYTE_OF = {c: b for b, c in enumerate(BYTE_CHARS)}


def tokenizer_config(path: Path) -> dict:
    tc = path / "tokenizer_config.json"
    return read_json(tc) if tc.exists() else {}


def chat_template(path: Path, config: dict) -> tuple[str | None, Path]:
    """The chat template and the file it comes from: chat_template.jinja, else tokenizer_config.json's chat_template,
    one string or a list of named templates ([{"name": "default", "template": ...}, ...]). Of a list we render
    "default", as transformers does when no tools are passed."""
    file = path / "chat_template.jinja"
    if file.exists():
        try:
            return file.read_text(encoding="utf-8"), file
        except UnicodeDecodeError as e:
            raise ModelError(f"{file} is not UTF-8 text ({e}): re-download the model") from None
    file, t = path / "tokenizer_config.json", config.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        if "default" not in named:
            raise ModelError(f"{file}: chat_template lists the templates {sorted(map(str, named))} but none named "
                             "'default', the one nanokv renders: rename one of them")
        t = named["default"]
    if t is not None and not isinstance(t, str):
        raise ModelError(f"{file}: chat_template must be a string or a list of {{name, template}} entries")
    return t, file


def template_env():
    """Jinja set up as transformers sets it up for chat templates: sandboxed (range() stops at 100,000 items),
    trim_blocks and lstrip_blocks, {% break %} and {% continue %}, raise_exception, strftime_now (Llama 3.2's
    templates print today's date) and a tojson that keeps non-ASCII text and key order as they are."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise TemplateError(msg)

    def tojson(x, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
        return json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = tojson
    return env


@dataclass
class Thought:
    """A generated answer split where its thinking ends."""
    tokens: int  # the thinking's tokens, </think> included (0: the answer did not think)
    closed: bool | None  # whether </think> came; None: no thinking in this answer
    answer: str  # the text after </think>, what a grader reads: all of it without thinking, "" if it never closed


def lone_surrogate(text: str) -> int | None:
    """Where text holds a lone surrogate (U+D800 to U+DFFF), which JSON's "\\ud800" and invalid UTF-8 bytes in argv
    give Python strings, but UTF-8 cannot encode; None when it holds none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


class Tokenizer:
    def __init__(self, path: str | Path, thinking: bool | None = None, name: str | None = None):
        """name: the model as the user named it (a Hub id rather than its snapshot directory), for our messages."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelError(f"no tokenizer.json in {path}: nanokv needs a Hugging Face fast tokenizer")
        try:
            self.tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise ModelError(f"{path / 'tokenizer.json'} cannot be read ({str(e).splitlines()[0]}): "
                             "re-download or re-convert the model") from None
        self.path, self.config = path, tokenizer_config(path)
        self.template, self.template_file = chat_template(path, self.config)
        self.compiled = None  # the template, compiled on first use
        self.thinks = bool(self.template) and THINK in self.template  # a thinking model's template writes <think>
        self.switch = bool(self.template) and "enable_thinking" in self.template  # Qwen3's switch
        self.thinking = None  # enable_thinking for a template with the switch; None: the template's default
        self.said_plain = False  # whether we told the user that prompts go in as plain text
        self.opener = None  # the generation prompt if it opens <think> (R1's), "" if not; found on first use (thought)
        special = lambda k: (lambda t: t["content"] if isinstance(t, dict) else t)(self.config.get(k)) or ""
        self.bos_token, self.eos_token = special("bos_token"), special("eos_token")
        cfg = ModelConfig.from_hf(path)
        gen = path / "generation_config.json"
        eos = set(cfg.eos_token_id) | set(token_ids(read_json(gen).get("eos_token_id"), gen) if gen.exists() else [])
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        self.eos_ids = sorted(eos)
        if thinking is not None and not self.switch:  # last: it renders the template, which needs the tokens above
            self.refuse(thinking, name or path)
        self.thinking = thinking

    def refuse(self, thinking: bool, name):
        """Refuse --thinking / --no-thinking on a template without the switch, unless it agrees with what the template
        does: --thinking where its generation prompt opens <think> (R1). A template that writes <think> only to format
        earlier turns' reasoning (Qwen3-Instruct-2507 strips it) does not make the model think: either flag would be a
        no-op that rows keyed `thinking` would misreport."""
        opens = self.thinks and self.opens_thinking()
        if thinking and opens:
            return
        what = ("always thinks (its template's generation prompt opens <think> and it has no enable_thinking switch)"
                if opens else "has no thinking switch (its template writes <think> only into earlier turns' "
                "reasoning, and its generation prompt opens none)" if self.thinks
                else "has no thinking mode (its chat template writes no <think>)")
        raise ModelError(f"--{'' if thinking else 'no-'}thinking: the model {name} {what}: drop the flag")

    def opens_thinking(self) -> bool:
        """Whether the template's generation prompt leaves <think> open: what it adds to a one-question conversation
        when asked for the assistant's turn (e.g. R1's '<｜Assistant｜><think>\\n'), not the <think> it may write
        elsewhere."""
        msg = [{"role": "user", "content": "?"}]
        turn, prompt = self.chat(msg, add_generation_prompt=False), self.chat(msg)
        added = prompt[len(turn):] if prompt.startswith(turn) else prompt
        return added.rfind(THINK) > added.rfind(END_THINK)

    def encode(self, text: str) -> list[int]:
        # the chat template already writes BOS (if any) as text, so we add no special tokens here
        bad = lone_surrogate(text)
        if bad is not None:  # the Rust tokenizer cannot take it: a traceback, deep inside
            raise ModelError(f"the text holds a lone surrogate at character {bad} ({text[bad]!r}, half of a UTF-16 "
                             "pair, not a character): fix that escape in the question, e.g. \\ud800")
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The bytes each token stands for: a character that spans tokens is split between them (decoding one token
        alone would turn each part into U+FFFD). Byte-level BPE spells byte b as the character BYTE_CHARS[b]; a
        special token is its text; any other tokenizer decodes token by token (its partial characters lost).
        Example (SmolLM2): the tokens 'Ġæ', '¸', '©' of " 温" -> [b" \xe6", b"\xb8", b"\xa9"]."""
        from tokenizers.decoders import ByteLevel

        added = self.tok.get_added_tokens_decoder()  # id -> AddedToken
        if not isinstance(self.tok.decoder, ByteLevel):
            return [self.decode([i]).encode() for i in ids]
        return [added[i].content.encode() if i in added else bytes(BYTE_OF[c] for c in self.tok.id_to_token(i))
                for i in ids]

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render messages with the model's own Jinja chat template, as HF's apply_chat_template does."""
        if not self.template:  # a base model: plain text, turn after turn
            if not self.said_plain:  # not silently: an instruct model without its template answers worse
                print(f"note: {self.path} has no chat template (chat_template.jinja, or chat_template in "
                      "tokenizer_config.json): prompts go in as plain text, one message per line", file=sys.stderr)
                self.said_plain = True
            return "\n".join(m["content"] for m in messages) + "\n"
        try:
            self.compiled = self.compiled or template_env().from_string(self.template)
            switch = {"enable_thinking": self.thinking} if self.switch and self.thinking is not None else {}
            return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **switch)
        except Exception as e:  # the template is code from the model's files, so any failure is theirs to fix
            line = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise ModelError(f"{self.template_file}: the chat template fails{line} ({type(e).__name__}: "
                             f"{(str(e) or '?').splitlines()[0]}): fix the template there") from None

    def generation_prompt(self) -> str:
        """What the template itself writes after the last turn: a one-turn conversation rendered with the generation
        prompt, less the same rendered without it. e.g. R1: "<｜Assistant｜><think>\n"; Qwen3:
        "<|im_start|>assistant\n", plus "<think>\n\n</think>\n\n" with enable_thinking false. It depends on the
        switch, not on the conversation, in every template nanokv renders (tool calls are left out), so one render
        serves every prompt."""
        if not self.thinks:
            return ""
        turn = [{"role": "user", "content": "?"}]
        with_, without = self.chat(turn), self.chat(turn, add_generation_prompt=False)
        return with_[len(os.path.commonprefix([with_, without])):]

    def thought(self, prompt: list[int], ids: list[int]) -> Thought:
        """Split generated ids where the thinking ends. An answer thinks when its prompt ends with a generation prompt
        that leaves <think> open (R1's template) or when it begins with <think> (Qwen3 thinking on its own); it ends
        with the token that completes </think>. Found in the bytes of the tokens, so it also works where </think> is no
        token of its own. e.g. R1: prompt "...<｜Assistant｜><think>\n", answer "x = 2.</think>So \\boxed{2}" ->
        tokens up to </think>, closed, answer "So \\boxed{2}"; Qwen3 with enable_thinking false: its prompt closed it,
        so 0, None, all. subtle: only the template's own words count: a user who writes <think> in the question opens
        nothing."""
        if self.opener is None:  # rendered once: the generation prompt, if it leaves <think> open (else "")
            gen = self.generation_prompt()
            self.opener = gen if gen.rfind(THINK) > gen.rfind(END_THINK) else ""
        # a token spells at least one byte, so the last len(opener) bytes' worth of tokens holds the whole opener
        head = b"".join(self.token_bytes(prompt[-len(self.opener.encode()):])) if self.opener else b""
        pieces = self.token_bytes(ids)
        text = b"".join(pieces)
        opened = bool(self.opener) and head.decode("utf-8", "replace").endswith(self.opener)
        if not (opened or text.lstrip().startswith(THINK.encode())):
            return Thought(0, None, self.decode(ids))
        end = text.find(END_THINK.encode())
        if end < 0:
            return Thought(len(ids), False, "")
        stop, n = end + len(END_THINK), 0
        for k, piece in enumerate(pieces):  # the token whose bytes reach past </think>
            n += len(piece)
            if n >= stop:
                break
        return Thought(k + 1, True, text[stop:].decode("utf-8", "replace"))
