"""Which part of the model each kernel inductor generates computes (the CP head and its sums, the LM head and its
loss, attention, the MLP, the rest), recorded when inductor names the kernel, so that a profile's kernels can be
grouped by model part rather than by their generated names (the CP head's FlexAttention kernels and attention's share
one name; the CP mixture's pointwise steps fuse into the LM head's reductions under names of their own).

torch.profiler's ranges (record_function, NVTX) do not survive torch.compile (dynamo drops them), so the part is read
where the kernel is written: inductor's define_kernel gets the fused nodes of each kernel, whose FX nodes carry the
module and source lines they came from (gpu_check/roofline.py's origin_category, the roofline's own attribution).
Each process that compiles writes {kernel name: part} lines to one file beside inductor's cache (append, a line at a
time), so a process that takes its graphs from that cache (which skips naming) reads the parts recorded when they
were compiled. Kernel names are numbered per graph: a name two graphs gave different parts reads "ambiguous". Library
calls (cuBLAS matmuls, sorts) are not generated kernels: a profile lists them apart.
"""
import collections
import json
import os

LIBRARY = "library calls (matmuls, sorts; by part in the roofline)"
UNKNOWN = "generated, part not recorded"


def part_of_schedule(nodes):
    """The part most of a kernel's FX nodes compute (the roofline's vote, its (T, V) rule aside)."""
    from roofline import majority_category, origins
    return majority_category(o for node in nodes if hasattr(node, "get_nodes") for o in origins(node))


def default_path():
    """Beside inductor's own cache (TORCHINDUCTOR_CACHE_DIR), which outlives a call: a graph that a later call takes
    from that cache (naming no kernel) finds the parts its first compile recorded."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return os.path.join(cache_dir(), "kernel_parts.jsonl")


def record_into(path):
    """From now on in this process, every kernel inductor defines (Triton on a GPU, C++ on a CPU) appends
    {"kernel", "part"} to path; True if the hook is in (a torch without these methods: False, nothing changed)."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
        from torch._inductor.codegen.triton import TritonScheduling
        schedulings = [(c, c.define_kernel) for c in (TritonScheduling, CppScheduling)]
    except (ImportError, AttributeError):
        return False

    def wrap(define):
        def define_and_record(self, src_code, nodes, *args, **kwargs):
            name = define(self, src_code, nodes, *args, **kwargs)
            try:
                line = json.dumps({"kernel": name, "part": part_of_schedule(nodes)})
                with open(path, "a") as f:
                    f.write(line + "\n")
            except Exception:  # the attribution must never cost the compile
                pass
            return name
        return define_and_record

    for scheduling, define in schedulings:
        original = getattr(define, "__wrapped_define__", define)  # installed twice: one hook, the latest path
        scheduling.define_kernel = wrap(original)
        scheduling.define_kernel.__wrapped_define__ = original
    return True


def read_parts(path):
    """{kernel name: part}; a name recorded with two parts (two graphs can number their kernels alike) is
    "ambiguous: A / B"."""
    found = collections.defaultdict(set)
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    found[entry["kernel"]].add(entry["part"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a killed writer
    return {k: v.pop() if len(v) == 1 else "ambiguous: " + " / ".join(sorted(v)) for k, v in found.items()}


def part_of_kernel(name, parts):
    """A profiled kernel's part: recorded, or a library call's, or generated but unrecorded."""
    if name in parts:
        return parts[name]
    if name.startswith("cp_lses_"):  # cp_kernel.py's, written by hand (--cp_backend lse_kernel): the CP sums
        from roofline import CATEGORIES
        return CATEGORIES[1]
    return UNKNOWN if name.startswith(("triton_", "cpp_")) else LIBRARY
