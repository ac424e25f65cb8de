"""
Models named by a Hugging Face Hub id, `ORG/NAME` or `ORG/NAME@REVISION` (a branch, tag or commit): downloaded once
with huggingface_hub's snapshot_download into its own cache, then read as a local directory, as gpt-fast and nano-vllm
do. We fetch only what nanokv reads (config, generation config, tokenizer files, chat template, the safetensors named
model*.safetensors and their index), and config.json first, alone, so that an architecture nanokv cannot run is refused
before gigabytes of weights arrive. The library's own rules hold: HF_HOME / HF_HUB_CACHE say where the cache is,
HF_HUB_OFFLINE=1 reads only the cache, HF_TOKEN (or `hf auth login`) opens gated models, and its progress bars show
the download. One rule is ours: without HF_HUB_OFFLINE we first check, within a few seconds, that the Hub's host
answers at all, and read only the cache when it does not (the library would retry for about half a minute first).
Left out: other repository types, PyTorch .bin checkpoints, GGUF repositories.
"""

import logging
import os
import re
import socket
import threading
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlsplit

from config import ModelConfig, ModelError

# what nanokv reads of a model repository (tokenizer.Tokenizer, config.ModelConfig, model.weight_files)
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "model.safetensors", "model-*.safetensors", "model.safetensors.index.json"]
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+(@[\w./-]+)?")  # what the Hub accepts as an id, with an optional @revision
SHORT_COMMIT = re.compile(r"[0-9a-f]{4,39}")  # an abbreviated commit hash: the cache knows commits by all 40 digits
REACH_S = 5.0  # how long we wait for the Hub's host to answer before reading only the cache


def is_hub_id(name: str | None) -> bool:
    """Whether --model names a Hub repository: ORG/NAME[@REVISION], and no file or directory of that name exists here
    (a local path always wins). e.g. "Qwen/Qwen3-0.6B@main" is one; "./Qwen3-0.6B", "/models/x" and "a/b/c" are not."""
    return bool(name) and HUB_ID.fullmatch(name) is not None and not os.path.exists(name)


def hub_model_dir(name: str) -> Path:
    """The local snapshot directory of a Hub id, downloaded into the Hugging Face cache unless it is there already.
    Every failure is one ModelError line: not cached and no network, gated, unknown id or revision, unsupported
    architecture (from config.json, before the weights are fetched)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.constants import ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    repo, _, revision = name.partition("@")
    at = f" at revision {revision!r}" if revision else ""
    offline = "HF_HUB_OFFLINE=1 is set" if HF_HUB_OFFLINE else None if reachable(ENDPOINT) else \
        f"the Hub ({ENDPOINT}) cannot be reached"
    cached = bool(offline)  # no network: the library's own offline path, without its retries
    log = logging.getLogger("huggingface_hub")  # its retry warnings would come before our one line; put back below
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        config = hf_hub_download(repo, "config.json", revision=revision or None, local_files_only=cached)
        try:
            ModelConfig.from_hf(config)  # refuses an architecture nanokv cannot run before the weights download
        except ModelError as e:
            raise ModelError(f"{name}: {str(e).replace(config, 'its config.json')}") from None
        snapshot = Path(snapshot_download(repo, revision=revision or None, allow_patterns=FILES,
                                          local_files_only=cached))
        lacks = [what for what, pattern in [("tokenizer.json", "tokenizer.json"), ("weights", "model*.safetensors")]
                 if not any(snapshot.glob(pattern))]
        if lacks and offline:  # online, snapshot_download fetched all there is: Tokenizer / load_model name what lacks
            raise ModelError(f"{name}: the cached snapshot {snapshot} is incomplete (no {' and no '.join(lacks)}: a "
                             f"download was cut off) and {offline}: finish it with network access (the same command, "
                             f"or {hf_download(repo, revision)})")
        return snapshot
    except GatedRepoError:  # before RepositoryNotFoundError, its parent class
        raise ModelError(f"{repo} is a gated model: accept its terms on https://huggingface.co/{repo}, then log in "
                         "(hf auth login, or set HF_TOKEN) and rerun") from None
    except RepositoryNotFoundError:
        raise ModelError(f"no model {repo!r} on the Hugging Face Hub (or it is private: log in with hf auth login, or "
                         "set HF_TOKEN): check the id, e.g. Qwen/Qwen3-0.6B") from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo} has no revision {revision!r}: name one of its branches, tags or commits") from None
    except RemoteEntryNotFoundError:
        raise ModelError(f"{repo}{at} has no config.json: it is not a transformers model repository") from None
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
        why = offline or "the Hub cannot be reached"
        short = ""
        if SHORT_COMMIT.fullmatch(revision):  # the cache maps branches and tags to commits, never a prefix to one
            short = (f"; {revision!r} looks like a short commit hash, which the cache can never resolve (it knows "
                     "commits by all 40 hex digits): give the full hash, or")
        raise ModelError(f"{name} is not in the Hugging Face cache ({HF_HUB_CACHE}) and {why}{short or ':'} download "
                         f"it once with network access (the same command, or {hf_download(repo, revision)}), or pass "
                         "--model a local directory") from None
    except HFValidationError as e:
        raise ModelError(f"--model {name} is not a valid Hugging Face id ({str(e).splitlines()[0]}): write ORG/NAME "
                         "or ORG/NAME@REVISION") from None
    except HfHubHTTPError as e:  # anything else the Hub answers (an outage, a rate limit)
        raise ModelError(f"the Hugging Face Hub refused {name}{at}: {str(e).splitlines()[0]}") from None
    except OSError as e:  # the cache's disk: full, read-only
        raise ModelError(f"could not write {name} into the Hugging Face cache: {e.strerror or e} (set HF_HOME to a "
                         "disk with room)") from None
    finally:
        log.setLevel(level)


def hf_download(repo: str, revision: str) -> str:
    """The command that fetches repo at revision, e.g. "hf download org/x --revision v2"."""
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def reachable(endpoint: str, timeout: float = REACH_S) -> bool:
    """Whether the Hub's host accepts a connection within timeout seconds (name lookup included, which has no timeout
    of its own, hence the thread). Behind a proxy (HTTPS_PROXY, ALL_PROXY) we cannot tell, so we let the library try."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    answered = []

    def connect():
        with suppress(OSError), socket.create_connection((url.hostname, port), timeout=timeout):
            answered.append(True)

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout)
    return bool(answered)
