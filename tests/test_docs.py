"""The documents: the README's quick start and the example run as written, no file of the repository uses a word
the project keeps out of it, and the documents cite only paths that exist in the repository."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "docs/design.md")
QUICK_START = re.compile(r"^#+ +Quick start\s*$", re.MULTILINE | re.IGNORECASE)
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# spelled in two parts so that this file does not contain the word it looks for
BANNED_WORD = re.compile(r"\b" + "sess" + r"ion\b", re.IGNORECASE)
# the suffixes that make a bare backticked name (no slash) a file name, such as `ops.py`
FILE_SUFFIXES = {".py", ".md", ".cuh", ".toml", ".cfg", ".txt", ".sh", ".json", ".yaml", ".yml"}
TOKEN_EDGES = "\"'()[]{}<>,;:!?"


def quick_start_source() -> str:
    """The first ```python block after the README's quick-start heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heading = QUICK_START.search(text)
    assert heading, "README.md has no 'Quick start' heading"
    block = PYTHON_BLOCK.search(text, heading.end())
    assert block, "README.md has no ```python block under its quick-start heading"
    return block.group(1)


def run_quick_start() -> dict:
    namespace = {"__name__": "readme_quick_start"}
    exec(compile(quick_start_source(), "README.md (quick start)", "exec"), namespace)
    return namespace


def test_readme_quick_start_runs():
    namespace = run_quick_start()
    out, lse = namespace["out"], namespace["lse"]
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(lse).all()  # every token of the quick start has valid entries


@pytest.mark.cuda
def test_readme_quick_start_runs_on_the_gpu():
    namespace = run_quick_start()
    assert namespace["device"] == "cuda" and namespace["out"].is_cuda
    assert isinstance(namespace.get("graph"), torch.cuda.CUDAGraph), "the quick start did not capture its graph"
    assert namespace["graph_out"].is_cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the example times the public configs")
def test_example_runs_small_on_the_cpu():
    command = [sys.executable, "-m", "examples.dsa_layer", "--config", "glm-5.3-flash", "--config", "deepseek-v3.2"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("No CUDA GPU") and len(lines) == 3
    for line, rows in zip(lines[1:], ("512+0", "512+64")):
        err = float(re.search(r"within (\S+) of max", line).group(1))
        assert f"{rows} latent rows" in line and err < 2**-7  # bfloat16 rounding of the output


def repository_files() -> list[Path]:
    """Tracked files, and untracked ones git does not ignore (they are what the next commit adds)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8", "surrogateescape")
    return sorted({ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()})


def test_no_file_uses_the_banned_word():
    hits = []
    for path in repository_files():
        data = path.read_bytes()
        if b"\0" in data:  # a binary file
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if BANNED_WORD.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def _words(piece: str) -> list[str]:
    words = (word.strip(TOKEN_EDGES).rstrip(".") for word in piece.split())
    return [word for word in words if word]


def _cited_words(text: str) -> list[tuple[str, bool]]:
    """The words of inline code spans and fenced blocks, each with whether it stands alone in an inline span (a
    bare file name is a citation there, and an argument of a command elsewhere: ``--json bench.json``)."""
    spans = INLINE_CODE.findall(FENCE.sub("", text))
    cited = [(word, len(_words(span)) == 1) for span in spans for word in _words(span)]
    return cited + [(word, False) for block in FENCE.findall(text) for word in _words(block)]


def _cited_path_problem(word: str, alone: bool, names: set[str]) -> str | None:
    """Why ``word`` of a code span is a bad citation of a path, or None (also for a word that is no path)."""
    if "://" in word:
        return None  # a URL
    if word.startswith(("/", "~")) and re.match(r"[/~][\w.-]+/", word):
        return "an absolute path"
    if word.startswith("../") or "/../" in word:
        return "a path outside the repository"
    if "/" in word:
        first = word.split("/", 1)[0]
        if not ((ROOT / first).exists() or Path(word.rstrip("/")).suffix in FILE_SUFFIXES):
            return None  # not a path: `int32/int64`, `GB/s`
        return None if (ROOT / word).exists() else "not in the repository"
    if alone and Path(word).suffix in FILE_SUFFIXES and re.fullmatch(r"[\w.-]+", word):
        return None if word in names else "no file of that name in the repository"
    return None


@pytest.mark.parametrize("doc", DOCS)
def test_documents_cite_only_repository_paths(doc):
    path = ROOT / doc
    text = path.read_text(encoding="utf-8")
    names = {p.name for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts}
    problems = []
    for word, alone in _cited_words(text):
        why = _cited_path_problem(word, alone, names)
        if why:
            problems.append(f"`{word}`: {why}")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, a mail address or an anchor
        target = target.split("#", 1)[0]
        if target.startswith("/") or ".." in Path(target).parts:
            problems.append(f"link {target}: outside the repository")
        elif not (path.parent / target).exists():
            problems.append(f"link {target}: not in the repository")
    for match in re.finditer(r"(?:^|[\s(\[\"'`])((?:/|\.\./)[\w.-]+/[\w./-]*)", text):
        problems.append(f"{match.group(1)}: an absolute path or a path outside the repository")
    assert not problems, f"{doc}:\n" + "\n".join(sorted(set(problems)))
