"""Summarises the GPU check (gpu_check.sh): versions, the CP reference check, and per mode the median step
time, tokens/s, MFU, peak memory, recompilations after warm-up and val loss at equal steps. The last line
is the CPLM / vanilla step-time ratio.
Usage: python records/gpu/gpu_report.py OUT_DIR   (holding gpu_cplm{0,1}.txt, stdout_cplm{0,1}.txt, ...)
"""
import importlib.util
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEAK_BF16_FLOPS = 790e12  # dense bf16 matrix rate measured on the H200 kind (device library, KINDS.md)


def load_compare():
    spec = importlib.util.spec_from_file_location("records_compare", os.path.join(HERE, "..", "compare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matmul_params(hp):
    """Weights in a matrix product per token (embeddings are lookups): 12 D^2 a layer with attention, 8 D^2
    for the MLP-only layer, the LM head, and the CP head's W_Q, W_K."""
    D, L = hp["model_dim"], hp["num_layers"]
    attention_layers = L - (0 <= hp.get("no_attention_layer", -1) < L)
    vocab = -(-(hp["vocab_size"] + 1) // 128) * 128
    return 8 * L * D * D + 4 * attention_layers * D * D + D * vocab + (2 * D * hp["cp_dim"] if hp["cplm"] else 0)


def recompiles(stdout_text):
    """(during warm-up, after warm-up): TORCH_LOGS=recompiles lines before and after the warm-up marker."""
    before, marker, after = stdout_text.partition("warm-up done")
    count = lambda text: len(re.findall(r"Recompiling function", text))  # noqa: E731
    return (count(before), count(after)) if marker else (count(before), None)


def summarize(log, stdout_text):
    train = log["train"]
    durations = [b["time_ms"] - a["time_ms"] for a, b in zip(train, train[1:])]
    hp = log["hyperparameters"]
    median_ms = statistics.median(durations) if durations else float("nan")
    tokens_per_s = hp["batch_size"] / (median_ms / 1000)
    return dict(median_ms=median_ms, tokens_per_s=tokens_per_s, steps=len(train),
                mfu=6 * matmul_params(hp) * tokens_per_s / PEAK_BF16_FLOPS, peak_mib=log["peak_mem_mib"],
                val={v["step"]: v["loss"] for v in log["val"]}, recompiles=recompiles(stdout_text))


def read(path):
    return open(path).read() if os.path.exists(path) else ""


def main(out_dir):
    compare = load_compare()
    print(read(os.path.join(out_dir, "versions.txt")).strip())
    cp_check = read(os.path.join(out_dir, "cuda_cp_check.txt")).strip().splitlines()
    print("CP reference check: " + (cp_check[-1] if cp_check else "missing"))
    runs = {}
    for mode in (0, 1):
        log = compare.parse_log(os.path.join(out_dir, f"gpu_cplm{mode}.txt"))
        runs[mode] = summarize(log, read(os.path.join(out_dir, f"stdout_cplm{mode}.txt")))
        head = [line for line in read(os.path.join(out_dir, f"gpu_cplm{mode}.txt")).splitlines()
                if line.startswith(("parameters:", "notice:"))]
        print(f"{('vanilla', 'cplm')[mode]}: " + " | ".join(head))
    print(f"{'mode':>8} {'steps':>6} {'median step':>12} {'tokens/s':>12} {'MFU (6N)':>9} {'peak MiB':>9} "
          f"{'recompiles in / after warm-up':>30}")
    for mode, name in ((0, "vanilla"), (1, "cplm")):
        r = runs[mode]
        during, after = r["recompiles"]
        print(f"{name:>8} {r['steps']:>6} {r['median_ms']:>10.2f}ms {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>8.1f}% "
              f"{r['peak_mib'] or float('nan'):>9} {during:>15} / {'no marker' if after is None else after}")
    print("MFU (6N): 6 x matmul weights x tokens/s over 790 TFLOP/s; attention's own FLOPs are not counted")
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
