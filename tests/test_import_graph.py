"""The shape of fot_jax's imports (issue 26): no circle among module-level project imports, and
project modules imported inside functions only where LAZY_IMPORTS says why.

Each module of the fot_jax package is parsed with `ast` (nothing is imported). A project import is
one of a fot_jax.* or data_pipelines.* module; `from fot_jax.x import y` is the module fot_jax.x.y
when that is a module, else fot_jax.x; a package's __init__ is the package. Importing a.b.c also
runs the __init__ of each package above it that the importer is not itself inside, so those are
edges too (that is how `fot_jax.checkpoint -> fot_jax.convert.hf_files` would close a circle
through fot_jax/convert/__init__.py).
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fot_jax", "data_pipelines")

# Every project import made inside a function of the fot_jax package (module, the function, the module it
# imports) with its reason. Everything else is imported at module level. Each one keeps TensorFlow, JAX
# or torch from loading on a path that does not need it.
LAZY_IMPORTS = {
    ("fot_jax", "from_pretrained", "fot_jax.convert.api"):
        "`import fot_jax.x` runs the package's __init__ first: it must not load JAX for every submodule",
    ("fot_jax.main", "_main", "fot_jax.runners.baselines"):
        "the LM experiments' SeqIO data loads TensorFlow; the dictionary task and --mode=plan do without",
    ("fot_jax.main", "_main", "fot_jax.runners.lm"): "as fot_jax.runners.baselines: TensorFlow for the LM experiments only",
    ("fot_jax.configs", "_resolve_lm", "data_pipelines.tasks"):
        "TensorFlow/SeqIO: only an LM config's data check needs the tasks and the vocabulary",
    ("fot_jax.configs", "_resolve_lm", "data_pipelines.vocab"): "as data_pipelines.tasks",
    ("fot_jax.configs", "_held_out_documents", "data_pipelines.pipeline"): "as data_pipelines.tasks (held-out documents)",
    ("fot_jax.configs", "_held_out_documents", "data_pipelines.vocab"): "as data_pipelines.tasks",
    ("fot_jax.convert.api", "vocabulary", "data_pipelines.vocab"):
        "TensorFlow/SeqIO: a loaded model needs a vocabulary only for text in or out, not to load",
    ("fot_jax.convert.verify", "verify_export", "fot_jax.convert.torch_reference"):
        "torch: only verify_export needs the PyTorch reference model",
    ("fot_jax.evaluate", "main", "fot_jax.eval.heads"):
        "the suites load JAX and TensorFlow: bad flags fail in one line before that (tests/bad_inputs.py)",
    ("fot_jax.evaluate", "main", "fot_jax.eval.suite"): "as fot_jax.eval.heads",
    ("fot_jax.study.__main__", "main", "fot_jax.study.run"):
        "a study run loads JAX and TensorFlow: a bad study file fails in one line before that",
}


def _modules(root: str = ROOT) -> Dict[str, str]:
  """{dotted module name: file} of every module of the project's packages."""
  out = {}
  for package in PACKAGES:
    for directory, _, files in os.walk(os.path.join(root, package)):
      for f in files:
        if not f.endswith(".py"):
          continue
        parts = os.path.relpath(os.path.join(directory, f), root)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        out[".".join(parts)] = os.path.join(directory, f)
  return out


def _is_project(name: str) -> bool:
  return name.split(".")[0] in PACKAGES


def _resolve(module: str, names: List[str], known: Set[str]) -> List[str]:
  """`from module import names` -> the project modules it imports."""
  out = []
  for n in names:
    sub = f"{module}.{n}"
    out.append(sub if sub in known else module)
  return out


def _with_parents(importer: str, target: str, known: Set[str]) -> List[str]:
  """target plus the packages above it that Python initialises on the way (not the importer's own)."""
  parts = target.split(".")
  out = [target] if target in known else []
  for i in range(1, len(parts)):
    parent = ".".join(parts[:i])
    if parent in known and parent != importer and not importer.startswith(parent + "."):
      out.append(parent)
  return out


def _imports(source: str, name: str, is_package: bool, known: Set[str]) -> Tuple[Set[str], List[Tuple[str, str]]]:
  """(project modules imported at module level, [(function, project module)] imported inside functions)."""
  top: Set[str] = set()
  lazy: List[Tuple[str, str]] = []

  def targets(node) -> List[str]:
    if isinstance(node, ast.Import):
      return [a.name for a in node.names if _is_project(a.name)]
    if node.level:  # relative: resolve against the importer's package
      base = name.split(".") if is_package else name.split(".")[:-1]
      base = base[:len(base) - node.level + 1]
      module = ".".join(base + ([node.module] if node.module else []))
    else:
      module = node.module or ""
    if not _is_project(module):
      return []
    return _resolve(module, [a.name for a in node.names], known)

  def visit(node, function: Optional[str]):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        found = targets(child)
        if function:
          lazy.extend((function, t) for t in found)
        else:
          for t in found:
            top.update(_with_parents(name, t, known))
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not function:
        visit(child, child.name)  # an import in a nested function is its outermost function's
      else:
        visit(child, function or ("<lambda>" if isinstance(child, ast.Lambda) else None))

  visit(ast.parse(source), None)
  top.discard(name)
  return top, lazy


def import_graph(root: str = ROOT) -> Tuple[Dict[str, Set[str]], Dict[str, List[Tuple[str, str]]]]:
  """({module: project modules it imports at module level}, {module: [(function, project module)]
  imported inside functions})."""
  modules = _modules(root)
  known = set(modules)
  graph, lazy = {}, {}
  for name, path in modules.items():
    with open(path, encoding="utf-8") as f:
      graph[name], lazy[name] = _imports(f.read(), name, path.endswith("__init__.py"), known)
  return graph, lazy


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
  """One cycle as [a, b, ..., a], or None."""
  state: Dict[str, int] = {}  # 1: on the stack, 2: done
  stack: List[str] = []

  def dfs(node) -> Optional[List[str]]:
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = dfs(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = dfs(node)
      if found:
        return found
  return None


def _write(directory, files: Dict[str, str]) -> None:
  """A synthetic package's files {relative path: source}, folders made as needed."""
  for rel, source in files.items():
    (directory / rel).parent.mkdir(parents=True, exist_ok=True)
    (directory / rel).write_text(source)


def test_the_cycle_finder_finds_a_known_cycle(tmp_path):
  _write(tmp_path, {"fot_jax/__init__.py": "", "fot_jax/a.py": "from fot_jax import b\n",
                    "fot_jax/b.py": "import os\nfrom fot_jax.a import thing\n\ndef f():\n  from fot_jax import a\n",
                    "fot_jax/c.py": "from fot_jax import a\n"})
  graph, lazy = import_graph(str(tmp_path))
  assert graph["fot_jax.a"] == {"fot_jax.b"} and graph["fot_jax.b"] == {"fot_jax.a"}
  assert find_cycle(graph) == ["fot_jax.a", "fot_jax.b", "fot_jax.a"]
  assert lazy["fot_jax.b"] == [("f", "fot_jax.a")] and sum(map(len, lazy.values())) == 1
  assert find_cycle({"x": {"y"}, "y": set()}) is None
  # a package's __init__ runs before its submodule: importing sub.m from outside is an edge to sub
  _write(tmp_path, {"fot_jax/b.py": "", "fot_jax/sub/__init__.py": "from fot_jax.sub import m\n",
                    "fot_jax/a.py": "from fot_jax.sub.m import x\n", "fot_jax/sub/m.py": "from fot_jax import c\n"})
  graph, _ = import_graph(str(tmp_path))
  assert graph["fot_jax.a"] == {"fot_jax.sub.m", "fot_jax.sub"} and graph["fot_jax.sub"] == {"fot_jax.sub.m"}
  assert find_cycle(graph) == ["fot_jax.a", "fot_jax.sub", "fot_jax.sub.m", "fot_jax.c", "fot_jax.a"]


def test_no_circle_among_module_level_imports():
  graph, _ = import_graph()
  assert "fot_jax.train.step" in graph and "fot_jax.model.init" in graph["fot_jax.train.step"]
  cycle = find_cycle(graph)
  assert cycle is None, f"module-level import circle: {' -> '.join(cycle)}"


def test_imports_inside_functions_are_the_listed_ones():
  _, lazy = import_graph()
  found = {(module, function, target) for module, imports in lazy.items() if module.split(".")[0] == "fot_jax"
           for function, target in imports}
  unlisted, gone = sorted(found - set(LAZY_IMPORTS)), sorted(set(LAZY_IMPORTS) - found)
  assert not unlisted, (f"project imports inside functions that LAZY_IMPORTS does not list: {unlisted}; import "
                        "them at module level, or list one with the reason it must wait (a heavy library)")
  assert not gone, f"LAZY_IMPORTS lists imports the code no longer makes: {gone}; remove them"
  # few functions wait for a heavy library (one may import several modules of it)
  assert len({(m, f) for m, f, _ in LAZY_IMPORTS}) <= 10 and all(reason for reason in LAZY_IMPORTS.values())
