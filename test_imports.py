"""The house: no file of the project imports a file that imports it (directly or through others), counting imports
inside functions too; and cpu_head.py's restated formulas are the script's, bit for bit."""
import ast
import glob
import os

import torch

import cpu_head
import train_gpt_cplm as tg

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_imports():
    """{file: {project files it imports}}: each module name resolves as the scripts find it: a file beside the
    importer, else at the root, else the project's one file of that name in another folder (the scripts put
    gpu_check/, experiments/ and tools/ on sys.path); a name that is no project file (torch, numpy) is none."""
    files = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)]
    files = [f for f in files if not f.startswith(("data" + os.sep + "prose", ".")) and "site-packages" not in f]
    by_name = {}
    for f in files:
        by_name.setdefault(os.path.basename(f)[:-3], []).append(f)
    graph = {}
    for f in files:
        names = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read(), f)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        here, graph[f] = os.path.dirname(f), set()
        for name in names:
            found = [t for t in (os.path.join(here, name + ".py"), name + ".py") if t in files]
            elsewhere = by_name.get(name, [])
            target = found[0] if found else elsewhere[0] if len(elsewhere) == 1 else None
            if target and target != f:
                graph[f].add(target)
    return graph


def test_no_file_imports_a_file_that_imports_it():
    graph = project_imports()
    assert "cpu_head.py" in graph["train_gpt_cplm.py"]  # imports inside functions are read
    assert os.path.join("tools", "compare.py") in graph[os.path.join("experiments", "race_report.py")]  # other folders
    cycles = []

    def visit(f, path):
        for t in sorted(graph[f]):
            if t in path:
                cycles.append(path[path.index(t):] + [t])
            elif t not in done:
                visit(t, path + [t])
        done.add(f)

    done = set()
    for f in sorted(graph):
        if f not in done:
            visit(f, [f])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_cpu_heads_restated_formulas_are_the_scripts_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(3, 50, 300, generator=g) * 20
    y = torch.randint(0, 300, (3, 50), generator=g)
    for cap in (0.0, 15.0, 30.0, 2.5):
        assert torch.equal(cpu_head.soft_cap(u, cap), tg.soft_cap(u, cap))
        for reduction in ("mean", "none"):
            assert torch.equal(cpu_head.vanilla_nll(u, y, cap, reduction), tg.vanilla_nll(u, y, cap, reduction))
