"""Peak resident memory of a generation, fasterllama against llama.cpp, each in its own process:
load the GGUF file, prefill a 128-token prompt, decode 128 greedy tokens, report VmHWM. Compared
with the budget the project holds itself to: the torch runtime (a process that only imports
torch, measured here too) + 1.2x the file's size + the KV cache the 256 tokens use (fp32).

    python benchmarks/memory.py [--model GGUF] [--skip llamacpp]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

_PEAK = "print(next(int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))"
IDS = "list(range(1000, 1128))"
PROGRAMS = {
    "import torch alone": "import torch\n" + _PEAK,
    "fasterllama": (
        "from fasterllama import LLM, SamplingParams\n"
        "llm = LLM({path!r}, progress=False)\n"
        f"llm.generate([{IDS}], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))\n" + _PEAK
    ),
    "llama.cpp": (
        "import llama_cpp\nimport numpy as np\n"
        "llm = llama_cpp.Llama({path!r}, n_ctx=512, n_threads=2, verbose=False)\n"
        f"llm.eval({IDS})\n"
        "for _ in range(128):\n"
        "    llm.eval([int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())])\n" + _PEAK
    ),
}


def peak_mb(program: str) -> int | None:
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed", file=sys.stderr)
        return None
    return int(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from fasterllama.loading import open_checkpoint
    from fasterllama.loading.registry import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--skip", default="", help="llamacpp: leave llama.cpp out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    cfg = open_checkpoint(path).config
    kv_mb = 256 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 / 2**20
    file_mb = os.path.getsize(path) / 2**20
    skip = set(filter(None, args.skip.split(",")))
    if "llamacpp" not in skip and importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp skipped: llama-cpp-python is not installed (pip install -e '.[llamacpp]')", file=sys.stderr)
        skip.add("llamacpp")
    results = {name: peak_mb(prog.format(path=path)) for name, prog in PROGRAMS.items()
               if not (name == "llama.cpp" and "llamacpp" in skip)}
    torch_mb = results["import torch alone"]
    budget = torch_mb + 1.2 * file_mb + kv_mb
    print(f"{os.path.basename(path)}: file {file_mb:.0f} MiB, KV cache of 256 tokens {kv_mb:.1f} MiB")
    print(f"budget = torch runtime {torch_mb} + 1.2 x file {1.2 * file_mb:.0f} + KV {kv_mb:.0f} = {budget:.0f} MiB\n")
    print("| process | peak resident MiB | of budget |\n|---|---:|---:|")
    for name, mb in results.items():
        print(f"| {name} | {mb if mb is not None else 'failed'} | {f'{mb / budget:.2f}' if mb else ''} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": path, "file_mib": file_mb, "kv_mib": kv_mb, "budget_mib": budget, "peak_mib": results}, fh, indent=2)


if __name__ == "__main__":
    main()
