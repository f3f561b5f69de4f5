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
    """{file: {project files it imports}}: a module name resolves to a file beside the importer, else at the root
    (the folders put both on sys.path), as the scripts themselves find them."""
    files = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)]
    files = [f for f in files if not f.startswith(("data" + os.sep + "prose", ".")) and "site-packages" not in f]
    graph = {}
    for f in files:
        names = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read(), f)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
        here = os.path.dirname(f)
        graph[f] = {target for name in names for target in (os.path.join(here, name + ".py"), name + ".py")
                    if target in files and target != f}
        graph[f] = {t for t in graph[f] if os.path.dirname(t) == here} or graph[f]  # beside it first
    return graph


def test_no_file_imports_a_file_that_imports_it():
    graph = project_imports()
    assert "train_gpt_cplm.py" in graph["cpu_head.py"] or "cpu_head.py" in graph["train_gpt_cplm.py"]  # read at all
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
