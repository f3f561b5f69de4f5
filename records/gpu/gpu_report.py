"""Summarises the GPU check's two speedrun logs (vanilla, CPLM): median step time, tokens/s, peak memory,
MFU, val loss at equal steps, recompilations; the last line is the CPLM / vanilla step-time ratio.
Usage: python records/gpu/gpu_report.py OUT_DIR   (holding gpu_cplm0.txt, gpu_cplm1.txt, stdout_cplm*.txt)
"""
import importlib.util
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEAK_BF16_FLOPS = 790e12  # dense bf16 matrix rate measured on this H200 kind (device library, KINDS.md)


def load_compare():
    spec = importlib.util.spec_from_file_location("records_compare", os.path.join(HERE, "..", "compare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matmul_params(hp):
    """Weights that take part in a matrix product per token (embeddings are lookups)."""
    D, L = hp["model_dim"], hp["num_layers"]
    vocab = -(-(hp["vocab_size"] + 1) // 128) * 128
    return 12 * L * D * D + D * vocab + (2 * D * hp["cp_dim"] if hp["cplm"] else 0)


def summarize(log, stdout_text):
    train = log["train"]
    durations = [b["time_ms"] - a["time_ms"] for a, b in zip(train, train[1:]) if b["step"] > 10]
    hp = log["hyperparameters"]
    median_ms = statistics.median(durations) if durations else float("nan")
    tokens_per_s = hp["batch_size"] / (median_ms / 1000)
    return dict(median_ms=median_ms, tokens_per_s=tokens_per_s,
                mfu=6 * matmul_params(hp) * tokens_per_s / PEAK_BF16_FLOPS, peak_mib=log["peak_mem_mib"],
                val={v["step"]: v["loss"] for v in log["val"]},
                recompiles=len(re.findall(r"Recompiling function", stdout_text)), steps=len(train))


def main(out_dir):
    compare = load_compare()
    runs = {}
    for mode in (0, 1):
        log = compare.parse_log(os.path.join(out_dir, f"gpu_cplm{mode}.txt"))
        stdout_path = os.path.join(out_dir, f"stdout_cplm{mode}.txt")
        runs[mode] = summarize(log, open(stdout_path).read() if os.path.exists(stdout_path) else "")
    print(f"{'mode':>8} {'steps':>6} {'median step':>12} {'tokens/s':>12} {'MFU (6N)':>9} {'peak MiB':>9} {'recompiles':>11}")
    for mode, name in ((0, "vanilla"), (1, "cplm")):
        r = runs[mode]
        print(f"{name:>8} {r['steps']:>6} {r['median_ms']:>10.1f}ms {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>8.1f}% "
              f"{r['peak_mib'] or float('nan'):>9} {r['recompiles']:>11}")
    print("val loss at equal steps:")
    for step in sorted(set(runs[0]["val"]) & set(runs[1]["val"])):
        print(f"  step {step:>5}: vanilla {runs[0]['val'][step]:.4f}  cplm {runs[1]['val'][step]:.4f}")
    if runs[0]["peak_mib"] and runs[1]["peak_mib"]:
        print(f"cplm/vanilla peak memory ratio: {runs[1]['peak_mib'] / runs[0]['peak_mib']:.3f}")
    print(f"cplm/vanilla step time ratio: {runs[1]['median_ms'] / runs[0]['median_ms']:.3f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    main(sys.argv[1])
