"""The README and docs/ checked against the repository: links, pages, commands, paths.

Fast and offline: files are read as text (and Hydra's YAML with ``yaml``), nothing is imported from
the package, no process is started.

* README.md stays under 300 lines, and links every page in docs/;
* every relative link in README.md and docs/*.md names a file that exists, and an ``#anchor``
  names a heading of that file (GitHub's heading ids);
* the README's test command is ``.ci/run``'s last command, and the quick-start commands install the
  pinned CPU build of torch (``.ci/run``'s) before anything else;
* every command shown in a ```bash / ```sh / ```console block that runs this repository's Python
  code (``python -m lightning_parallel...``, ``python examples/X.py``, ``python benchmarks/X.py``,
  ``torchrun ... -m MODULE``, ``srun ... python ...``, ``bash benchmarks/X.sh``) names a module or
  file that exists; each ``--flag`` it passes appears in that script's source (``"--flag"``, as
  argparse declares it); for the Hydra apps (the scripts that compose ``conf/``), each ``key=value``
  override names a config group with that option, a key of that group's files, or a top-level key;
  the same for a command written in inline code (`` `python benchmarks/bench_tp.py --rounds 3` ``);
* every file path written in inline code (`` `parallel/data/apply.py` ``) exists in the repository;
* docs/architecture.md describes every folder of the package.

A Hydra app is recognised by its source naming ``CONF_DIR`` (``lightning_parallel/train.py`` and the
dry run ``lightning_parallel/plan.py``, which composes the same config).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONF = ROOT / "conf"
CI = ROOT / ".ci" / "run"
MAX_README_LINES = 300

PAGES = [README, *sorted(DOCS.glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Top-level packages whose scripts the docs may run (anything else, e.g. `python -m pytest`, is not ours).
OUR_PACKAGES = ("lightning_parallel", "benchmarks", "examples")
# Hydra's own command-line flags, accepted by every Hydra app.
HYDRA_FLAGS = {"-m", "--multirun", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--resolve", "--package",
               "-p", "--run", "-r", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
               "--shell-completion", "-sc", "--version"}
# Programs shown in the docs whose flags cannot be read from a script of this repository, each with the reason.
# What is still checked for them is done in `check_command`.
FLAGS_NOT_IN_SOURCE = {
    "lightning-parallel": "the Lightning CLI: `--config`, `--trainer.*`, `--print_config` are LightningCLI's (jsonargparse) "
                          "flags, not declared in lightning_parallel/cli.py; the subcommand and `--config` files are checked",
}
LIGHTNING_CLI_SUBCOMMANDS = {"fit", "validate", "test", "predict"}


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str


def fenced_blocks(page: Path) -> list[Block]:
    blocks, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, lang, start = opening.group(2), opening.group(3).lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append(Block(page, start + 1, lang, "\n".join(body)))
        i += 1
    return blocks


def prose(page: Path) -> str:
    """The page without its fenced blocks (their lines kept blank, so line numbers stay)."""
    out, fence = [], None
    for line in page.read_text().splitlines():
        opening = re.match(r"^\s*(```+|~~~+)", line)
        if fence is None and opening:
            fence = opening.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def inline_code(text: str) -> list[str]:
    """Inline code spans, whitespace (a span may wrap onto the next line) collapsed to single spaces."""
    return [" ".join(span.split()) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text)]


def links(page: Path) -> list[str]:
    text = re.sub(r"(?<!`)`[^`\n]+`(?!`)", "", prose(page))  # a link written in code is not a link
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


def github_anchor(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(page).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = github_anchor(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def shell_commands(block: Block) -> Iterator[tuple[int, list[str]]]:
    """(line, tokens) of every simple command in a shell block: continuations joined, comments dropped,
    split at `&&`, `||`, `;` and `|`; a console block's commands are its `$ ` lines."""
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [line.lstrip()[2:] if line.lstrip().startswith("$ ") else "" for line in lines]
    joined: list[tuple[int, str]] = []
    pending, first = "", 0
    for number, line in enumerate(lines, start=block.line + 1):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((first, pending + line))
        pending = ""
    if pending:
        joined.append((first, pending))
    for number, line in joined:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                if command:
                    yield number, command
                command = []
            else:
                command.append(token)
        if command:
            yield number, command


def all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in fenced_blocks(page):
            if block.lang in SHELL_LANGS:
                for line, tokens in shell_commands(block):
                    found.append((f"{page.relative_to(ROOT)}:{line}", tokens))
    return found


# ---------------------------------------------------------------------------------------------- commands


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def conf_group_keys(group: Path) -> set[str]:
    keys: set[str] = set()
    for path in group.glob("*.yaml"):
        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, dict):
            keys.update(str(k) for k in data)
    return keys


def check_override(override: str) -> str | None:
    """None if `key=value` names something in conf/, else why not."""
    key, _, value = override.lstrip("+~").partition("=")
    root_keys = set(yaml.safe_load((CONF / "config.yaml").read_text()))
    if "/" in key:  # a nested group, e.g. hydra/launcher=slurm
        group = CONF / key
    elif "." not in key and (CONF / key).is_dir():
        group = CONF / key
    else:
        head, _, rest = key.partition(".")
        if (CONF / head).is_dir():
            sub = rest.split(".")[0]
            keys = conf_group_keys(CONF / head)
            return None if sub in keys else f"`{sub}` is no key of conf/{head}/*.yaml ({sorted(keys)})"
        return None if head in root_keys else f"`{head}` is neither a config group in conf/ nor a key of conf/config.yaml"
    if not group.is_dir():
        return f"conf/{key}/ is not a config group"
    missing = [v for v in (v.strip() for v in value.split(",")) if v and v != "null" and not (group / f"{v}.yaml").is_file()]
    return f"conf/{key}/ has no {missing}" if missing else None


def check_script(script: Path, args: list[str]) -> list[str]:
    """The flags and Hydra overrides `args` passes to `script`: each must be known to it."""
    source = script.read_text()
    hydra_app = "CONF_DIR" in source  # composes conf/ (the Hydra app and the dry run)
    problems = []
    for arg in args:
        if arg.startswith("-") and not re.fullmatch(r"-\d.*", arg):
            flag = arg.split("=", 1)[0]
            if hydra_app and flag in HYDRA_FLAGS:
                continue
            if f'"{flag}"' not in source and f"'{flag}'" not in source:
                problems.append(f"{flag} is not a flag of {script.relative_to(ROOT)}")
        elif hydra_app and "=" in arg:
            why = check_override(arg)
            if why:
                problems.append(f"override {arg}: {why}")
    return problems


def check_command(tokens: list[str]) -> list[str] | None:
    """Problems with one shell command, or None when it runs nothing of this repository."""
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # OMP_NUM_THREADS=1 python ...
        tokens = tokens[1:]
    if not tokens:
        return None
    names = [Path(t).name for t in tokens]
    if names[0] in ("bash", "sh") and len(tokens) > 1 and tokens[1].endswith(".sh"):
        return [] if (ROOT / tokens[1]).is_file() else [f"{tokens[1]} does not exist"]
    if names[0] in FLAGS_NOT_IN_SOURCE:  # lightning-parallel: see FLAGS_NOT_IN_SOURCE
        problems = [] if len(tokens) > 1 and tokens[1] in LIGHTNING_CLI_SUBCOMMANDS else [f"no subcommand {tokens[1:2]}"]
        for i, token in enumerate(tokens):
            if token.startswith("--config"):
                path = token.split("=", 1)[1] if "=" in token else (tokens[i + 1] if i + 1 < len(tokens) else "")
                if not (ROOT / path).is_file():
                    problems.append(f"--config {path} does not exist")
        return problems
    # `srun ... python ...`, `torchrun ... -m module ...`: the wrapper's own flags are not checked.
    interpreters = ("torchrun", "python", "python3")
    start = next((i for i, n in enumerate(names) if n in interpreters or re.fullmatch(r"python3\.\d+", n)), None)
    if start is None:
        return None
    rest = tokens[start + 1:]
    if names[start] == "torchrun":  # torchrun's own options come before the module or script it runs
        at = next((i for i, t in enumerate(rest) if t in ("-m", "--module") or t.endswith(".py")), None)
        if at is None:
            return ["torchrun runs no module or script"]
        rest = ["-m", *rest[at + 1:]] if rest[at] in ("-m", "--module") else rest[at:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        module, args = rest[1], rest[2:]
        if module.split(".")[0] not in OUR_PACKAGES:
            return None  # python -m venv / pip / pytest
        script = module_file(module)
        if script is None:
            return [f"module {module} does not exist"]
    elif rest and rest[0].endswith(".py"):
        args = rest[1:]
        if Path(rest[0]).parts[0] not in OUR_PACKAGES:
            return None
        script = ROOT / rest[0]
        if not script.is_file():
            return [f"{rest[0]} does not exist"]
    else:
        return None  # `python -c ...`, a bare interpreter
    return check_script(script, args)


# ---------------------------------------------------------------------------------------------- paths


def repository_files() -> tuple[set[str], set[str]]:
    """Relative paths of the repository's files and folders (no virtual environments, caches or run outputs)."""
    skip = {".git", "__pycache__", "outputs", "multirun", "node_modules", ".pytest_cache"}
    files, dirs = set(), set()
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.name in skip or entry.name.startswith(".venv"):
                continue
            rel = entry.relative_to(ROOT).as_posix()
            if entry.is_dir():
                dirs.add(rel)
                stack.append(entry)
            else:
                files.add(rel)
    return files, dirs


SUFFIXES = (".py", ".sh", ".yaml", ".toml", ".png", ".md")


def paths_in(span: str) -> list[str]:
    """Repository paths written in one inline-code span: `a/b.py`, `b.py`, `folder/`; not absolute paths,
    URLs, or bare output names such as `compare.md` (a bare name counts for .py, .sh and .yaml only)."""
    found = []
    for word in span.split():
        word = word.strip(",;:()[]'\"")
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", word) or word.startswith(("/", ".")) or "://" in span:
            continue
        if word.endswith("/") or ("/" in word and word.endswith(SUFFIXES)) or word.endswith((".py", ".sh", ".yaml")):
            found.append(word)
    return found


def path_exists(path: str, files: set[str], dirs: set[str]) -> bool:
    """`path` names a file (or, ending in `/`, a folder) of the repository, given whole or as its trailing part."""
    pool = dirs if path.endswith("/") else files | dirs
    path = path.rstrip("/")
    return path in pool or any(p.endswith("/" + path) for p in pool)


# ---------------------------------------------------------------------------------------------- tests


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines (limit {MAX_README_LINES}): move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: {path} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with id #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links none of {missing}"


def _quick_start_lines() -> list[list[list[str]]]:
    """The quick start's command lines, each as its simple commands (split at `&&`)."""
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in fenced_blocks(README) if b.lang in SHELL_LANGS and b.text in section]
    lines: dict[int, list[list[str]]] = {}
    for block in blocks:
        for number, tokens in shell_commands(block):
            lines.setdefault(block.line * 10_000 + number, []).append(tokens)
    return list(lines.values())


def _quick_start_commands() -> list[list[str]]:
    return [tokens for line in _quick_start_lines() for tokens in line]


def _ci_commands() -> list[str]:
    return [line.strip() for line in CI.read_text().splitlines() if line.strip() and not line.strip().startswith("#")]


def test_readme_test_command_is_the_ci_command() -> None:
    ci_test = _ci_commands()[-1]
    shown = [" ".join(tokens) for tokens in _quick_start_commands() if tokens[:3] == ["python", "-m", "pytest"]]
    assert shown == [" ".join(shlex.split(ci_test))], f"README's test command {shown} is not .ci/run's last command {ci_test!r}"
    assert ci_test in README.read_text(), "the README's test command must be .ci/run's, byte for byte"


def test_quick_start_installs_the_pinned_torch_first() -> None:
    pins = {t for line in _ci_commands() for t in shlex.split(line) if t.startswith("torch==")}
    assert len(pins) == 1, f".ci/run pins torch once: {pins}"
    pin = pins.pop()
    lines = _quick_start_lines()
    assert len(lines) == 2, f"the quick start shows two command lines (the main job, the tests): {lines}"
    for line in lines:
        installs = [tokens[2:] for tokens in line if tokens[:2] == ["pip", "install"]]
        assert installs and installs[0] == [pin], f"the first install must be .ci/run's `pip install {pin}`: {installs}"
        assert any(args[:1] == ["-e"] for args in installs[1:]), f"the package is installed after torch: {installs}"
    runs = [" ".join(line[-1]) for line in lines]
    assert runs[0] == "python -m lightning_parallel.train", runs


def test_shown_commands_name_existing_scripts_flags_and_overrides() -> None:
    problems, checked = [], 0
    for where, tokens in all_commands():
        found = check_command(tokens)
        if found is None:
            continue
        checked += 1
        problems += [f"{where}: {' '.join(tokens)}\n    {p}" for p in found]
    assert checked >= 20, f"only {checked} commands checked: is the parser still finding the blocks?"
    assert not problems, "\n".join(problems)


def test_paths_in_inline_code_exist() -> None:
    files, dirs = repository_files()
    missing = [f"{page.relative_to(ROOT)}: `{span}` names {path}, which does not exist"
               for page in PAGES for span in inline_code(prose(page)) for path in paths_in(span)
               if not path_exists(path, files, dirs)]
    assert not missing, "\n".join(missing)


def test_commands_in_inline_code_name_existing_scripts_flags_and_overrides() -> None:
    """The same check for a command written in running text (`python benchmarks/bench_tp.py --rounds 3`,
    `benchmarks/bench_tp.py --rounds 3`): only spans that name a script or module; fragments such as
    `torchrun --max-restarts N` are not commands of this repository."""
    problems, checked = [], 0
    for page in PAGES:
        for span in inline_code(prose(page)):
            if re.match(r"^(benchmarks|examples)/[\w/-]+\.py\b", span):
                span = "python " + span
            if not re.match(r"^([A-Za-z_]\w*=\S+ )*(python3?|torchrun|srun|bash)\s", span):
                continue
            try:
                tokens = shlex.split(span)
            except ValueError:
                problems.append(f"{page.relative_to(ROOT)}: `{span}` does not parse as a shell command")
                continue
            if "-m" not in tokens and not any(t.endswith((".py", ".sh")) for t in tokens):
                continue
            found = check_command(tokens)
            if found is not None:
                checked += 1
                problems += [f"{page.relative_to(ROOT)}: `{span}`: {p}" for p in found]
    assert checked >= 10, f"only {checked} inline commands checked"
    assert not problems, "\n".join(problems)


def test_architecture_page_names_every_package_folder() -> None:
    """docs/architecture.md describes every folder of the package (a new subpackage needs its line)."""
    text = (DOCS / "architecture.md").read_text()
    package = ROOT / "lightning_parallel"
    folders = sorted(p.parent.relative_to(package).as_posix() for p in package.rglob("__init__.py") if p.parent != package)
    missing = [f for f in folders if f"`{f}/`" not in text and f"`lightning_parallel/{f}/`" not in text
               and f"`{f.rsplit('/', 1)[-1]}/`" not in text]
    assert not missing, f"docs/architecture.md does not describe {missing}"


def test_the_checks_catch_what_they_are_for() -> None:
    """The parser and the checks on known-bad input (so a silent parser cannot pass everything)."""
    text = "A=1 python -m lightning_parallel.train strategy=nope \\\n  trainer.devices=2 && echo ok  # note"
    block = Block(Path("example.md"), 1, "bash", text)
    commands = list(shell_commands(block))
    assert commands == [(2, ["A=1", "python", "-m", "lightning_parallel.train", "strategy=nope", "trainer.devices=2"]),
                        (2, ["echo", "ok"])]
    assert check_command(commands[0][1]) == ["override strategy=nope: conf/strategy/ has no ['nope']"]
    assert check_command(["python", "-m", "lightning_parallel.train", "trainer.no_such_key=1"])
    assert check_command(["python", "-m", "lightning_parallel.train", "nosuchgroup=1"])
    assert check_command(["python", "benchmarks/bench_tp.py", "--no-such-flag"])
    assert check_command(["python", "benchmarks/no_such_bench.py"])
    assert check_command(["torchrun", "--nnodes", "2", "-m", "lightning_parallel.no_such_module"])
    assert check_command(["srun", "-n", "8", "python", "-m", "lightning_parallel.train", "-m", "hydra/launcher=nope"])
    assert check_command(["bash", "benchmarks/no_such.sh"])
    assert check_command(["python", "-m", "lightning_parallel.train", "-m", "strategy=dp,zero3", "trainer.devices=2"]) == []
    assert check_command(["python", "-m", "pytest", "-q", "tests"]) is None
    assert github_anchor("Options (`HybridParallelStrategy(...)`, or `strategy.<option>=` in Hydra)") == \
        "options-hybridparallelstrategy-or-strategyoption-in-hydra"
    assert not path_exists("parallel/zero.py", *repository_files())
