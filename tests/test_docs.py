"""Every snippet of README.md and docs/*.md is loaded or run here, so that none can rot.

The pages are found by globbing (a new page under docs/ is tested as soon as it exists). A fenced block
is loaded by its language, and an HTML comment on the line before it, ``<!-- doc-test: WORDS -->``,
says how when the language does not:

* ``python``: executed as a fresh module (in a temporary working directory); every ``dg.Definitions``
  it leaves is validated as a code server would load it. ``continues``: executed in the namespace of
  the page's previous Python block.
* ``yaml``: ``defs.yaml`` (the default for a mapping with ``type:``): a component file, loaded and
  built in a throwaway ``dg`` project as ``dg check defs`` does; ``scaffold NAME``: exactly what
  ``dg scaffold defs faucet_dagster.components.FaucetComponent NAME`` writes in the example project,
  which then still loads; ``file PATH``: exactly the repository's file PATH (``docs/workspace.yaml`` is
  also served to a real webserver workspace); ``dagster.yaml``: a Dagster instance's settings;
  ``sync-fields`` / ``stream-fields``: fields of one sync or stream, loaded inside a component;
  ``connector-config NAME ROLE``: a connector's config, parsed as that role builds it.
* shell (``bash``, ``console``, ``sh``, ``shell``): every ``faucet`` command is parsed by the real
  command line, and every ``python -m MODULE`` must name a module that exists; ``run``: each
  ``$ faucet ...`` command runs, and its output must match the lines shown (``...`` alone stands for
  any lines, inside a line for any text; runs of spaces compare as one).
* ``env:NAME=VALUE`` (any block): set while it loads.

Blocks in other languages (``text``) are output shown for reading. The README also stays a quickstart:
at most 250 lines, linking every page of docs/, with the two commands CI and a new user run. Every
relative link and image resolves.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from dagster._core.instance.config import dagster_instance_config
from dagster._core.workspace.config_schema import ensure_workspace_config
from dagster.components.testing import create_defs_folder_sandbox

from faucet_dagster.cli.main import _parser, main
from faucet_dagster.protocol import Role, get_connector
from faucet_dagster.testing.servers._base import _free_port as free_port
from faucet_dagster.testing.servers._base import port_accepts

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "example_project"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WRITTEN_ELSEWHERE = {
    "docs/dagster-ui.md",
    "docs/values-and-schemas.md",
    "docs/verification.md",
    "docs/conformance.md",
}
"""Pages the README links that other branches are writing: a link to one may dangle until they merge."""
LINKED_BY_THE_README_REWRITE = {"docs/duckdb.md", "docs/delta.md"}
"""Pages written on branches that may not edit README.md (another branch rewrites it): the README's
link to each is added when the branches merge, and this set then emptied."""
README_MAX_LINES = 250
COMMAND_ONE = (
    "python3 -m venv .venv && .venv/bin/pip install -q -e . && "
    "(cd example_project && ../.venv/bin/python -m example_project)"
)
SHELLS = {"bash", "console", "sh", "shell"}
KINDS: dict[str, dict[str, int]] = {
    "python": {"continues": 0},
    "yaml": {
        "defs.yaml": 0,
        "scaffold": 1,
        "file": 1,
        "dagster.yaml": 0,
        "sync-fields": 0,
        "stream-fields": 0,
        "connector-config": 2,
    },
    "shell": {"run": 0, "command-one": 0, "test-command": 0},
}
"""The kinds of marker each family of blocks takes, and how many arguments each kind takes."""
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<words>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w.+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its language, its marker's words and its text."""

    page: Path
    line: int
    lang: str
    words: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def family(self) -> str:
        return "shell" if self.lang in SHELLS else self.lang

    @property
    def kind(self) -> str | None:
        """The marker's first word, which says how the block is loaded (None: by its language)."""
        plain = [word for word in self.words if not word.startswith("env:")]
        return plain[0] if plain else None

    def arguments(self) -> list[str]:
        """The marker's words after its kind."""
        return [word for word in self.words if not word.startswith("env:")][1:]

    @property
    def env(self) -> dict[str, str]:
        return dict(word[4:].split("=", 1) for word in self.words if word.startswith("env:"))


def read_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = len(opening["indent"])
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = MARKER.match(previous)
        text = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
        words = tuple(marker["words"].split()) if marker else ()
        blocks.append(Block(page, index + 1, opening["lang"], words, text))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]


def blocks_of(family: str) -> list[Block]:
    return [block for block in BLOCKS if block.family == family]


def ids(blocks: list[Block]) -> list[str]:
    return [block.where for block in blocks]


# -- the README as a quickstart, and the links of every page -------------------------------------------


def test_the_readme_is_a_quickstart_that_links_every_reference_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {target for page, target in links(ROOT / "README.md")}
    unlinked = [
        f"docs/{page.name}"
        for page in (ROOT / "docs").glob("*.md")
        if f"docs/{page.name}" not in linked | LINKED_BY_THE_README_REWRITE
    ]
    assert not unlinked, f"README.md links no {unlinked}"
    [one] = [block for block in BLOCKS if "command-one" in block.words]
    assert one.page.name == "README.md" and one.text.strip() == COMMAND_ONE
    assert (EXAMPLE / "example_project" / "__main__.py").is_file()  # tests/test_example_project.py runs it
    [test] = [block for block in BLOCKS if "test-command" in block.words]
    assert test.page.name == "README.md" and test.text.strip() == "./scripts/test"
    # CI runs exactly the README's test command.
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("exec ./scripts/test")
    assert os.access(ROOT / "scripts" / "test", os.X_OK)


def links(page: Path) -> Iterator[tuple[Path, str]]:
    """Every relative link and image of ``page`` outside code, as (page, target relative to ROOT)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", "", text)
    for match in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        yield page, resolved.relative_to(ROOT).as_posix() + (f"#{anchor}" if anchor else "")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slug(match.group(1)) for match in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_every_link_and_image_resolves() -> None:
    broken = []
    for page in PAGES:
        for source, target in links(page):
            path, _, anchor = target.partition("#")
            if not (ROOT / path).exists():
                if path not in WRITTEN_ELSEWHERE:
                    broken.append(f"{source.relative_to(ROOT)}: {target} does not exist")
            elif anchor and path.endswith(".md") and anchor not in anchors(ROOT / path):
                broken.append(f"{source.relative_to(ROOT)}: {path} has no heading #{anchor}")
    assert not broken, "\n".join(broken)


def test_every_block_says_how_it_is_loaded() -> None:
    problems = []
    for block in BLOCKS:
        kinds = KINDS.get(block.family, {})
        if block.kind is not None and block.kind not in kinds:
            problems.append(
                f"{block.where}: a {block.lang} block is not loaded as {block.kind!r} ({sorted(kinds)})"
            )
        elif block.kind is not None and len(block.arguments()) != kinds[block.kind]:
            problems.append(f"{block.where}: {block.kind} takes {kinds[block.kind]} argument(s)")
        if block.family == "yaml" and block.kind is None:
            loaded = yaml.safe_load(block.text)
            if not (isinstance(loaded, dict) and "type" in loaded):
                problems.append(f"{block.where}: a YAML block that is no component says how it is loaded")
    assert not problems, "\n".join(problems)


# -- Python ---------------------------------------------------------------------------------------------


def python_chains() -> list[list[Block]]:
    """The Python blocks, each with the blocks it continues from."""
    chains: list[list[Block]] = []
    for block in blocks_of("python"):
        if block.kind == "continues":
            assert chains and chains[-1][-1].page == block.page, f"{block.where} continues nothing"
            chains.append([*chains[-1], block])
        else:
            chains.append([block])
    return chains


@pytest.mark.parametrize("chain", python_chains(), ids=[chain[-1].where for chain in python_chains()])
def test_python_snippet_runs_and_its_definitions_load(
    chain: list[Block], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for package in (ROOT / "examples").glob("*/pyproject.toml"):
        monkeypatch.syspath_prepend(str(package.parent))  # a worked example the docs import from
    name = f"doc_snippet_{chain[-1].page.stem.replace('-', '_')}_{chain[-1].line}"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    for number, block in enumerate(chain):
        for key, value in block.env.items():
            monkeypatch.setenv(key, value)
        source = tmp_path / f"{name}_{number}.py"  # a real file: Dagster reads code references from it
        source.write_text(block.text)
        module.__file__ = str(source)
        exec(compile(block.text, str(source), "exec"), module.__dict__)
    definitions = [value for value in vars(module).values() if isinstance(value, dg.Definitions)]
    for defs in definitions:
        dg.Definitions.validate_loadable(defs)


# -- YAML -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block",
    [b for b in blocks_of("yaml") if b.kind != "scaffold"],
    ids=ids([b for b in blocks_of("yaml") if b.kind != "scaffold"]),
)
def test_yaml_snippet_loads(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in block.env.items():
        monkeypatch.setenv(key, value)
    kind = block.kind or "defs.yaml"
    if kind == "defs.yaml":
        load_component(block.text)
    elif kind in ("sync-fields", "stream-fields"):
        load_component(with_fields(kind, yaml.safe_load(block.text)))
    elif kind == "file":
        [path] = block.arguments()
        assert block.text == (ROOT / path).read_text(), f"{block.where} differs from {path}"
        if path.endswith("workspace.yaml"):
            ensure_workspace_config(yaml.safe_load(block.text), str(ROOT / path))
    elif kind == "dagster.yaml":
        (tmp_path / "dagster.yaml").write_text(block.text)
        dagster_instance_config(str(tmp_path))
    elif kind == "connector-config":
        connector, role = block.arguments()
        get_connector(connector).build(Role(role), yaml.safe_load(block.text))


def load_component(text: str) -> None:
    """``text`` as a component's ``defs.yaml`` in a throwaway ``dg`` project, built and validated."""
    with create_defs_folder_sandbox() as sandbox:
        folder = sandbox.defs_folder_path / "snippet"
        folder.mkdir()
        (folder / "defs.yaml").write_text(text)
        with sandbox.build_all_defs() as defs:
            dg.Definitions.validate_loadable(defs)
            assert defs.assets or defs.sensors, "the component declares nothing"


def with_fields(kind: str, fields: dict[str, Any]) -> str:
    """A component with one sync or one stream holding ``fields`` over minimal ones."""
    assert isinstance(fields, dict), "the block holds a mapping of fields"
    sync = {
        "name": "orders",
        "source": {"connector": "files", "config": {"paths": ["data/*.csv"]}},
        "sink": {"connector": "sql", "config": {"url": "sqlite:///warehouse.db", "table": "orders"}},
    }
    stream = {
        "name": "events",
        "source": {"connector": "nats", "config": {"servers": ["nats://localhost:4222"], "stream": "EVENTS"}},
        "sink": {
            "connector": "postgres",
            "config": {"url": "postgresql://app@localhost/db", "table": "events"},
        },
        "resources": ["EVENTS"],
    }
    attributes = {"syncs": [sync | fields]} if kind == "sync-fields" else {"streams": [stream | fields]}
    return yaml.safe_dump({"type": "faucet_dagster.components.FaucetComponent", "attributes": attributes})


def copy_example(tmp_path: Path) -> Path:
    copy = tmp_path / "example_project"
    shutil.copytree(
        EXAMPLE, copy, ignore=shutil.ignore_patterns(".faucet_data", ".dagster_home", "__pycache__")
    )
    return copy


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the terminal's width nor a Dagster home, plus ``extra``."""
    drop = {"COLUMNS", "LINES", "DAGSTER_HOME", "FAUCET_STATE_URL"}
    return {key: value for key, value in os.environ.items() if key not in drop} | extra


def test_dg_scaffold_writes_what_the_docs_show_and_it_loads_beside_the_example(tmp_path: Path) -> None:
    [block] = [b for b in blocks_of("yaml") if b.kind == "scaffold"]
    [name] = block.arguments()
    project = copy_example(tmp_path)
    dg_cli = str(Path(sys.executable).with_name("dg"))
    env = clean_env()
    scaffold = ["scaffold", "defs", "faucet_dagster.components.FaucetComponent", name]
    done = subprocess.run(
        [dg_cli, *scaffold], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    written = (project / "example_project" / "defs" / name / "defs.yaml").read_text()
    assert written.strip() == block.text.strip(), f"{block.where} is not what dg scaffold writes:\n{written}"
    # The example's own syncs and the scaffolded one load together: no name collides.
    listed = subprocess.run(
        [dg_cli, "list", "defs", "--json"], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assets = {asset["asset_key"] for asset in json.loads(listed.stdout)["assets"]}
    assert {"customers", "orders", name} <= assets


def test_the_shipped_workspace_file_serves_the_example_from_one_code_server(tmp_path: Path) -> None:
    """docs/workspace.yaml, its port changed to a free one, loads the example from `dagster api grpc`."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    shipped = (ROOT / "docs" / "workspace.yaml").read_text()
    documented = re.search(r"dagster api grpc -m (\S+) -p (\d+)", shipped)
    assert documented is not None, "the file says how to start its code server"
    module, port = documented.groups()
    assert shipped.count(f"port: {port}") == 1
    free = free_port()
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(shipped.replace(f"port: {port}", f"port: {free}"))
    project = copy_example(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(DAGSTER_HOME=str(home))
    dagster = str(Path(sys.executable).with_name("dagster"))
    server = subprocess.Popen(
        [dagster, "api", "grpc", "-m", module, "-p", str(free)],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_server(server, free)
        with (
            dg.instance_for_test(temp_dir=str(home)) as instance,
            WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[str(workspace)])) as context,
        ):
            request = context.create_request_context()
            assert not request.get_code_location_error("example_project")
            location = request.get_code_location("example_project")
            [repository] = location.get_repositories().values()
            keys = {node.asset_key.to_user_string() for node in repository.get_asset_node_snaps()}
            assert {"customers", "orders"} <= keys
    finally:
        server.terminate()
        server.wait(timeout=60)


def wait_for_server(server: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 180
    while not port_accepts("127.0.0.1", port):
        assert server.poll() is None, (
            f"the code server exited: {server.stderr.read() if server.stderr else ''}"
        )
        assert time.monotonic() < deadline, f"no code server on port {port} after 180 s"
        time.sleep(0.5)


# -- shell ----------------------------------------------------------------------------------------------

CONTROL = {"&&", "||", ";", "|", "&", "(", ")"}


@dataclass
class Command:
    words: list[str]
    output: list[str] = field(default_factory=list)


def commands(block: Block) -> list[Command]:
    """The commands of a shell block (``$ `` prompts in a console block), with the output shown after
    each; a command continued by a backslash is joined."""
    lines = block.text.splitlines()
    prompted = block.lang == "console"
    found: list[Command] = []
    pending = ""
    for line in lines:
        if prompted and not pending and not line.startswith("$ "):
            if found:
                found[-1].output.append(line)
            continue
        pending += (line[2:] if prompted and not pending else line).split(" #")[0]
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        for words in split_commands(pending):
            found.append(Command(words))
        pending = ""
    return found


def split_commands(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line, without their variable assignments."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    current: list[str] = []
    for token in [*lexer, ";"]:
        if token in CONTROL:
            while current and re.match(r"^\w+=", current[0]):
                current.pop(0)
            if current:
                yield current
            current = []
        else:
            current.append(token)


def program(words: list[str]) -> str:
    return Path(words[0]).name


@pytest.mark.parametrize("block", blocks_of("shell"), ids=ids(blocks_of("shell")))
def test_shell_snippet_names_real_commands(block: Block) -> None:
    for command in commands(block):
        if program(command.words) == "faucet":
            parse_faucet(block, command.words[1:])
        elif program(command.words).startswith("python") and command.words[1:2] == ["-m"]:
            assert module_exists(command.words[2]), f"{block.where}: no module {command.words[2]}"
        elif command.words[0].startswith("./"):
            assert os.access(ROOT / command.words[0], os.X_OK), f"{block.where}: no {command.words[0]}"


def module_exists(name: str) -> bool:
    """Whether ``python -m name`` finds a module, in the example project (where the docs run its
    modules) or installed, without importing it (nor its package)."""
    path = Path(*name.split("."))
    for root in (EXAMPLE, ROOT):
        if (root / path).with_suffix(".py").is_file() or (root / path / "__main__.py").is_file():
            return True
    top = name.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return spec is not None and name == top
    return any(
        (Path(location) / Path(*name.split(".")[1:])).with_suffix(".py").is_file()
        or (Path(location, *name.split(".")[1:]) / "__main__.py").is_file()
        for location in spec.submodule_search_locations
    )


def parse_faucet(block: Block, arguments: list[str]) -> None:
    try:
        _parser().parse_args(arguments)
    except SystemExit as exc:
        assert exc.code == 0, f"{block.where}: faucet {shlex.join(arguments)} does not parse"


RUN_BLOCKS = [block for block in blocks_of("shell") if block.kind == "run"]


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=ids(RUN_BLOCKS))
def test_shell_snippet_prints_what_the_docs_show(
    block: Block, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    for name in ("COLUMNS", "LINES", "DAGSTER_HOME", "FAUCET_STATE_URL"):
        monkeypatch.delenv(name, raising=False)
    for key, value in block.env.items():
        monkeypatch.setenv(key, value)
    for command in commands(block):
        assert program(command.words) == "faucet", f"{block.where}: only faucet commands are run"
        try:
            code = main(command.words[1:])
        except SystemExit as exc:  # --help
            code = exc.code if isinstance(exc.code, int) else 2
        printed = capsys.readouterr()
        shown = shlex.join(command.words)
        assert code in (0, 1), f"{block.where}: {shown} failed:\n{printed.out}{printed.err}"
        assert matches(command.output, printed.out), (
            f"{block.where}: {shown} printed\n{printed.out}\nwhich the docs show as\n"
            + "\n".join(command.output)
        )


def matches(shown: list[str], printed: str) -> bool:
    """Whether ``printed`` is what the docs show: ``...`` stands for any text (lines included), and
    whitespace compares loosely (a terminal's width wraps help text at another place)."""
    pieces = [squeeze(piece) for piece in "\n".join(shown).split("...")]
    pattern = r".*?".join(r"\s+".join(map(re.escape, piece.split(" "))) if piece else "" for piece in pieces)
    return re.fullmatch(pattern, squeeze(printed), re.DOTALL) is not None


def squeeze(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
