"""The user's Ansible inventory, read by Ansible itself, for one purpose: which host is which node.

Whatever ``ansible-playbook -i`` accepts is accepted here, because Ansible reads it: INI, YAML
and TOML files, a folder of inventory sources, host ranges (``gpu[01:03]``), ``group_vars/``
and ``host_vars/`` beside the inventory, executable inventory scripts and inventory plugin
configs (``plugin: ansible.builtin.constructed``, ``amazon.aws.aws_ec2``, ...). One
``ansible-inventory --list`` run per load (for a static inventory whose files did not change since
the last read, the listing that read kept: engine.connectors.inventory_cache), in a child process
with the environment runbook's playbook runs get (a private ``ANSIBLE_HOME`` and an empty
``ansible.cfg``, so the user's own Ansible config is not read here either;
``allowed_environment``: an allow-list, never the engine's environment minus a deny-list, so an
inventory script or plugin never sees the server's tokens or secrets, while the variables the
operator names in ``RUNBOOK_ANSIBLE_ENV`` reach it and the playbook runs alike); a source Ansible
cannot parse fails the load instead of being skipped with a
warning. Measured against ansible-core's ``InventoryManager`` +
``VariableManager`` in-process (docs/inventory.md): the child costs ~0.3 s more per run but keeps
ansible-core's global config, plugin loader and vars-plugin caches out of a long-lived
``runbook serve``, and its JSON output is a stable interface where the Python API is not.

The mapping rule: a node maps to the host whose variable ``k8s_node_name`` names it (from any
variable source Ansible merges: inline, group vars, host vars, a constructed ``compose``), else
to the host of the same name. Two hosts claiming one node is a located error. Values are never
interpreted beyond ``k8s_node_name`` and ``ansible_host``: inline ``!vault`` values stay opaque
(``{"__ansible_vault": ...}``), so an inventory with vaulted values loads without the vault
password (a wholly vaulted vars file needs it, as it does for ``ansible-playbook``).

What this module must not do: import ansible-core (it runs ``ansible-inventory``), run
playbooks, resolve templates, or read secrets.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.connectors import inventory_cache
from engine.errors import HostError, LoadError, Location

NODE_VAR = "k8s_node_name"
READ_TIMEOUT = 120.0  # seconds: a script or cloud plugin that hangs is an error, not a stuck run
SECRET_ENV = ("RUNBOOK_BECOME_PASSWORD",)  # never handed to the child (nor any RUNBOOK_* secret)
# The only variables of the engine's own environment that reach Ansible's processes - inventory
# reads and playbook runs alike (plus LC_* and those named in RUNBOOK_ANSIBLE_ENV): what
# ansible-playbook, Python, ssh, sudo's prompt matching and the locale need. RUNBOOK_TEST_TAG is
# the test suites' marker for counting leftover processes (docs/reliability.md); not a secret.
CHILD_ENV_ALLOWED = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
    "SSH_AUTH_SOCK", "PYTHONPATH", "VIRTUAL_ENV", "RUNBOOK_TEST_TAG",
})
PASS_ENV = "RUNBOOK_ANSIBLE_ENV"  # the operator's names (NAME or PREFIX*, comma-separated) passed on too
_PASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\*?$")


def passed_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The names (``NAME`` or ``PREFIX*``) of ``RUNBOOK_ANSIBLE_ENV``; ``LoadError`` naming the
    variable and the entry for a malformed one, a bare ``*`` or one of runbook's own variables."""
    out = []
    for raw in env.get(PASS_ENV, "").replace(",", " ").split():
        problem = ""
        if not _PASS_NAME.match(raw) or len(raw.rstrip("*")) < 2:
            problem = "not a variable name or a NAME_PREFIX* pattern"
        elif raw.upper().startswith("RUNBOOK_") or "RUNBOOK_".startswith(raw.upper().rstrip("*")):
            problem = "runbook's own variables (tokens, secrets) never reach Ansible"
        if problem:
            raise LoadError([(Location(f"environment variable {PASS_ENV}"), f"{raw[:60]!r}: {problem}")])
        out.append(raw)
    return tuple(out)


def allowed_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """What of ``parent`` (the engine's environment) Ansible's processes get: ``CHILD_ENV_ALLOWED``,
    ``LC_*`` and the names of ``RUNBOOK_ANSIBLE_ENV`` (cloud or CMDB credentials an inventory plugin
    needs, ``ANSIBLE_*`` settings), nothing else whatever its name."""
    names = passed_names(parent)
    exact = {n for n in names if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))

    def passes(key: str) -> bool:
        if key.startswith("RUNBOOK_"):
            return key in CHILD_ENV_ALLOWED
        return key in CHILD_ENV_ALLOWED or key.startswith("LC_") or key in exact or key.startswith(prefixes)

    return {k: v for k, v in parent.items() if passes(k)}
_MAX_SCAN = 1_000_000  # bytes: files larger than this are not searched when locating a claim


@dataclass(frozen=True)
class InventoryHost:
    name: str  # the inventory hostname Ansible uses (``--limit``)
    node: str  # the Kubernetes node it runs
    address: str = ""  # ``ansible_host`` when given
    groups: tuple[str, ...] = ()
    vars: Mapping[str, Any] = field(default_factory=dict)  # host variables as Ansible merged them


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: Mapping[str, InventoryHost]  # by inventory hostname

    def host_for_node(self, node: str) -> str:
        """The inventory hostname of a Kubernetes node; ``HostError`` when none is known."""
        for host in self.hosts.values():
            if host.node == node:
                return host.name
        raise HostError(f"node {node} is not in the inventory {self.path} (no host named {node} "
                        f"and no host with {NODE_VAR}: {node})", host=node)

    def node_for_host(self, host: str) -> str:
        entry = self.hosts.get(host)
        return entry.node if entry else host

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted(h.node for h in self.hosts.values()))

    def group(self, name: str) -> tuple[str, ...]:
        """Inventory hostnames in a group (direct or through children)."""
        return tuple(sorted(h.name for h in self.hosts.values() if name in h.groups))


def load_inventory(path: Path, *, timeout: float = READ_TIMEOUT) -> Inventory:
    """Read an inventory (file, folder, script or plugin config) the way ``ansible-playbook -i`` does.

    Raises ``LoadError`` (``PATH[:LINE]: message``) when Ansible cannot parse a source, when
    ``k8s_node_name`` is not a plain node name, or when two hosts claim the same node.
    """
    path = Path(path)
    listing, warnings = read_listing(path, timeout=timeout)
    return inventory_from_listing(path, listing, warnings=warnings)


# ============================================================================ reading (effects)


def read_listing(path: Path, *, timeout: float = READ_TIMEOUT) -> tuple[Mapping[str, Any], list[str]]:
    """``ansible-inventory -i PATH --list`` as parsed JSON, with Ansible's warnings; ``LoadError``
    when Ansible refuses the inventory. Collects the read ``start_reading`` began for the same
    path when its sources did not change since (else reads anew)."""
    if not path.exists():
        _discard(path)
        raise LoadError([(Location(str(path)), "inventory not found")])
    resolved = path.resolve()
    stamp = _stamp(resolved)
    key = _cache_key(resolved, stamp)
    if key is not None and (kept := inventory_cache.load(resolved, key)) is not None:
        _discard(path)  # a read begun early is not needed
        return kept
    started = _take_started(path)
    child = started if started is not None else _spawn(path)
    listing, warnings = _collect(path, child, timeout)
    if key is not None and child.stamp == stamp == _stamp(resolved):
        inventory_cache.store(resolved, key, listing, warnings)  # the sources did not change meanwhile
    return listing, warnings


def _cache_key(resolved: Path, stamp: tuple[Any, ...] | None = None) -> str | None:
    """The key under which a read of ``resolved`` (its sources as ``stamp``, else as they are now)
    is kept (engine.connectors.inventory_cache); None for a dynamic inventory, or when it cannot be
    told."""
    try:
        if not is_static(resolved):
            return None
        env = allowed_environment(os.environ)
        return inventory_cache.cache_key(resolved, stamp if stamp is not None else _stamp(resolved), env)
    except (LoadError, OSError):
        return None


@dataclass
class _Child:
    """One ``ansible-inventory`` process and the private folder it runs in."""

    proc: subprocess.Popen[str]
    folder: tempfile.TemporaryDirectory[str]
    stamp: tuple[Any, ...]  # the sources' stat and the environment when it started (``_stamp``)
    started: float = field(default_factory=time.monotonic)


_started: dict[Path, _Child] = {}  # begun by start_reading, not yet collected (by resolved path)
_started_lock = threading.Lock()


def start_reading(path: Path | None) -> None:
    """Begin reading ``path`` now, in the background, for this process's next ``load_inventory``
    of the same path to collect: the CLI calls it first thing in the commands that plan or run, so
    that the ``ansible-inventory`` child (~0.5 s) runs while the engine imports its modules and
    loads the runbook. Never raises: what is wrong (no such file, Ansible missing) is for
    ``load_inventory`` to say, as before. A read whose sources change before it is collected is
    thrown away (the load reads anew); one nobody collects is ended at exit."""
    if path is None:
        return
    with contextlib.suppress(Exception):  # the load reports it
        key = Path(path).resolve()
        if not key.exists() or not is_static(key):
            return
        cache_key = _cache_key(key)
        if cache_key is not None and inventory_cache.load(key, cache_key) is not None:
            return  # the load takes the kept listing: no child needed
        with _started_lock:
            if key in _started:
                return
            _started[key] = _spawn(key)
            if len(_started) == 1:
                _register_exit()


def _take_started(path: Path) -> _Child | None:
    key = path.resolve()
    with _started_lock:
        child = _started.pop(key, None)
    if child is None:
        return None
    if child.stamp != _stamp(key):  # changed meanwhile: the read may have seen either version
        _end(child)
        return None
    return child


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        with _started_lock:
            child = _started.pop(path.resolve(), None)
        if child is not None:
            _end(child)


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_end_uncollected)


def _end_uncollected() -> None:
    with _started_lock:
        children = list(_started.values())
        _started.clear()
    for child in children:
        _end(child)


def _end(child: _Child) -> None:
    if child.proc.poll() is None:
        _kill_group(child.proc)
    else:
        with contextlib.suppress(Exception):
            child.proc.communicate(timeout=5)
    child.folder.cleanup()


_PLUGIN_KEY = re.compile(r"^plugin\s*:", re.M)


def is_static(path: Path) -> bool:
    """Whether reading ``path`` only reads files: no source is an executable script or an inventory
    plugin's config (a YAML ``plugin:`` key: a cloud API, a CMDB), whose reading may cost money, hit a
    rate limit or change, so it is started only when a load needs it (``start_reading``)."""
    sources = [p for p in sorted(path.rglob("*")) if p.is_file() and not _in_vars_dir(p, path)] \
        if path.is_dir() else [path]
    for f in sources:
        try:
            if f.stat().st_mode & 0o111 or f.stat().st_size > _MAX_SCAN:
                return False
            if _PLUGIN_KEY.search(f.read_text(encoding="utf-8", errors="replace")):
                return False
        except OSError:
            return False
    return True


def sources_stamp(path: Path) -> tuple[Any, ...]:
    """What tells whether the files Ansible reads for ``path`` changed: the stat (mtime and ctime in
    ns, size, inode) of the source (every file of a folder source) and of ``group_vars/`` and
    ``host_vars/`` beside it."""
    base = path if path.is_dir() else path.parent
    files = [path] if not path.is_dir() else []
    for folder in (path, base / "group_vars", base / "host_vars") if path.is_dir() else \
            (base / "group_vars", base / "host_vars"):
        if folder.is_dir():
            for root, dirs, names in os.walk(folder):
                dirs.sort()
                files.extend(Path(root) / n for n in sorted(names))
    out: list[Any] = []
    for f in dict.fromkeys(files):
        try:
            st = f.stat()
            out.append((str(f), st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append((str(f), None))
    return tuple(out)


def _stamp(path: Path) -> tuple[Any, ...]:
    """The sources' stamp and the environment the child gets (``RUNBOOK_ANSIBLE_ENV`` may name
    settings of an inventory plugin): a read begun under others is not collected."""
    env: tuple[Any, ...]
    try:
        env = tuple(sorted(allowed_environment(os.environ).items()))
    except LoadError as e:  # a malformed RUNBOOK_ANSIBLE_ENV: the load says so
        env = (str(e),)
    return (sources_stamp(path), env)


def _spawn(path: Path) -> _Child:
    """Start ``ansible-inventory --list`` for ``path`` in a private folder; ``LoadError`` when it cannot."""
    stamp = _stamp(path.resolve())
    folder = tempfile.TemporaryDirectory(prefix="runbook-inventory-")
    d = Path(folder.name)
    try:
        (d / "ansible.cfg").write_text("# written by runbook: isolates the inventory read\n[defaults]\n")
        for sub in ("home", "tmp"):
            (d / sub).mkdir(mode=0o700)
        argv = [sys.executable, "-m", "ansible.cli.inventory", "-i", str(path.resolve()), "--list"]
        # its own session: a timeout or ^C ends it with the scripts it started
        proc = subprocess.Popen(argv, env=_child_env(d), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:
        folder.cleanup()
        raise LoadError([(Location(str(path)), f"cannot run ansible-inventory: {e}")]) from e
    except BaseException:
        folder.cleanup()
        raise
    return _Child(proc, folder, stamp)


def _collect(path: Path, child: _Child, timeout: float) -> tuple[Mapping[str, Any], list[str]]:
    """Wait for ``child`` (at most ``timeout`` seconds from its start) and parse what it printed."""
    proc = child.proc
    try:
        try:
            # counted from its start (a read begun early has used some already); at least a
            # second to take what a finished child printed
            left = max(1.0, timeout - (time.monotonic() - child.started))
            stdout, stderr = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise LoadError([(Location(str(path)), f"Ansible did not finish reading the inventory in "
                                                   f"{timeout:g} s (a hanging inventory script or "
                                                   "plugin?)")]) from None
        except BaseException:
            _kill_group(proc)
            raise
    finally:
        child.folder.cleanup()
    if proc.returncode != 0:
        raise LoadError(parse_failure(path, stderr))
    try:
        listing = json.loads(stdout)
    except ValueError as e:
        raise LoadError([(Location(str(path)), f"ansible-inventory printed no JSON listing: {e}")]) from e
    if not isinstance(listing, dict):
        raise LoadError([(Location(str(path)), "ansible-inventory printed no JSON listing")])
    return listing, warnings_of(stderr)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def _child_env(d: Path) -> dict[str, str]:
    """The environment of ``ansible-playbook`` runs (engine.connectors.ansible), plus strictness."""
    env = allowed_environment(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(d / "ansible.cfg"),
        "ANSIBLE_HOME": str(d / "home"),
        "ANSIBLE_LOCAL_TEMP": str(d / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        # Ansible only warns about a source it cannot parse and goes on without its hosts: for a
        # remediation tool, a host silently missing is worse than a refusal.
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    })
    for name in SECRET_ENV:
        env.pop(name, None)
    return env


_FAILED = re.compile(r"^\[WARNING\]:\s*(?:\*\s*)?Failed to parse (?:inventory )?(?:\S+ )?with '?([\w.]+)'? plugin: "
                     r"(.*)$")
_ORIGIN = re.compile(r"^Origin: (/[^<>]*?)(?::(\d+)(?::(\d+))?)?\s*$")
_PLUGIN_ORIGIN = re.compile(r"^Origin: <inventory plugin .* with source '(.+)'>\s*$")
_WARNING = re.compile(r"^\[WARNING\]:\s*(.*)$")
_ERROR = re.compile(r"^\[ERROR\]:\s*(.*)$")


def parse_failure(path: Path, stderr: str) -> list[tuple[Location, str]]:
    """Ansible's complaints (stderr of a failed ``ansible-inventory``) as located problems.

    Each plugin that tried a source and failed says why and where (``Origin: FILE[:LINE[:COL]]``);
    when some of them name a line, the others (e.g. the INI plugin choking on a YAML file) are
    noise and dropped. Falls back to Ansible's ``[ERROR]`` lines at the inventory's path."""
    lines = stderr.splitlines()
    failures: list[tuple[Location, str, str]] = []  # (where, message, plugin)
    for i, line in enumerate(lines):
        m = _FAILED.match(line.strip())
        if not m:
            continue
        plugin, message = m.group(1), m.group(2).strip()
        location = Location(str(path))
        for following in lines[i + 1:]:
            if _FAILED.match(following.strip()) or _ERROR.match(following.strip()):
                break
            o = _ORIGIN.match(following.strip())
            if o:
                location = Location(o.group(1), int(o.group(2) or 1),
                                    int(o.group(3)) if o.group(3) else None)
                break
            o = _PLUGIN_ORIGIN.match(following.strip())
            if o:
                location = Location(o.group(1))
                break
        failures.append((location, f"{plugin} plugin: {message}", plugin))
    problems = _unique((loc, msg) for loc, msg, _ in _relevant(failures))
    if not problems:
        errors = [m.group(1).strip() for line in lines if (m := _ERROR.match(line.strip()))]
        detail = "; ".join(errors) or (stderr.strip().splitlines() or ["ansible-inventory failed"])[-1]
        problems = [(Location(str(path)), f"Ansible cannot read this inventory: {detail}")]
    return problems


def _relevant(failures: list[tuple[Location, str, str]]) -> list[tuple[Location, str, str]]:
    """Of the plugins that failed on a source, the ones whose complaint is about that source's
    kind: a YAML file's syntax error, not the INI plugin's (or ``auto``'s "no plugin key")."""
    def keep(rule: Callable[[tuple[Location, str, str]], bool]) -> None:
        nonlocal failures
        kept = [f for f in failures if rule(f)]
        failures = kept or failures

    keep(lambda f: f[0].line > 1 or bool(f[0].column))
    keep(lambda f: "no root 'plugin' key found" not in f[1])
    keep(lambda f: not (Path(f[0].path).suffix in (".yml", ".yaml", ".json") and f[2] in ("ini", "toml")))
    return failures


def warnings_of(stderr: str) -> list[str]:
    """Ansible's ``[WARNING]`` lines (first line of each)."""
    return [m.group(1).strip() for line in stderr.splitlines() if (m := _WARNING.match(line.strip()))]


def _unique(problems: Iterable[tuple[Location, str]]) -> list[tuple[Location, str]]:
    return list(dict.fromkeys(problems))


# ============================================================================ mapping (pure)


def inventory_from_listing(path: Path, listing: Mapping[str, Any], *,
                           warnings: Sequence[str] = ()) -> Inventory:
    """The ``--list`` JSON -> ``Inventory``, applying the mapping rule; ``LoadError`` on a conflict
    or when there is no host at all (with Ansible's ``warnings``, which then say why)."""
    meta = listing.get("_meta")
    hostvars: Mapping[str, Any] = (meta.get("hostvars") if isinstance(meta, dict) else None) or {}
    groups = _groups_of_hosts(listing)
    names = list(dict.fromkeys([*hostvars, *groups]))
    problems: list[tuple[Location, str]] = []
    hosts: dict[str, InventoryHost] = {}
    claimed: dict[str, str] = {}  # node -> host
    by_var: dict[str, bool] = {}  # host -> claims its node through k8s_node_name
    for name in names:
        entry = hostvars.get(name)
        host_vars: Mapping[str, Any] = _plain(entry) if isinstance(entry, dict) else {}
        node = host_vars.get(NODE_VAR, name)
        if not isinstance(node, str) or not node.strip() or "{{" in node or "{%" in node:
            problems.append((locate_claim(path, name, str(node)),
                             f"host {name}: {NODE_VAR} must be a plain node name, not {node!r}"))
            continue
        if node in claimed:
            first = claimed[node]
            problems.append((locate_claim(path, name, node, by_variable=NODE_VAR in host_vars),
                             f"hosts {first} and {name} both claim node {node} ({first}: "
                             f"{_where(locate_claim(path, first, node, by_variable=by_var[first]))})"))
            continue
        claimed[node] = name
        by_var[name] = NODE_VAR in host_vars
        address = host_vars.get("ansible_host")
        hosts[name] = InventoryHost(
            name=name, node=node, address=address if isinstance(address, str) else "",
            groups=tuple(sorted(groups.get(name, {"all"}))),
            vars=MappingProxyType(dict(host_vars)))
    if not names:
        said = f" (Ansible warned: {'; '.join(warnings)})" if warnings else ""
        problems.append((Location(str(path)), f"Ansible found no hosts in this inventory{said}"))
    if problems:
        raise LoadError(problems)
    return Inventory(path=path, hosts=MappingProxyType(hosts))


def _plain(value: Any) -> Any:
    """A value of the listing without Ansible's ``{"__ansible_unsafe": x}`` wrapper (values from
    scripts and plugins are marked unsafe for templating; runbook never templates them)."""
    if isinstance(value, dict):
        if set(value) == {"__ansible_unsafe"}:
            return _plain(value["__ansible_unsafe"])
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _groups_of_hosts(listing: Mapping[str, Any]) -> dict[str, set[str]]:
    """host -> every group it is in, directly or through children (``all`` included)."""
    members: dict[str, set[str]] = {}
    children: dict[str, list[str]] = {}
    for group, body in listing.items():
        if group == "_meta" or not isinstance(body, dict):
            continue
        members[group] = {str(h) for h in body.get("hosts") or ()}
        children[group] = [str(c) for c in body.get("children") or ()]

    def hosts_of(group: str, seen: frozenset[str]) -> set[str]:
        found = set(members.get(group, ()))
        for child in children.get(group, ()):
            if child not in seen:
                found |= hosts_of(child, seen | {child})
        return found

    out: dict[str, set[str]] = {}
    for group in members:
        for host in hosts_of(group, frozenset({group})):
            out.setdefault(host, {"all"}).add(group)
    return out


# ============================================================================ locating a claim


def locate_claim(path: Path, host: str, node: str, *, by_variable: bool = True) -> Location:
    """Best effort: the file and line that make ``host`` claim ``node`` (``by_variable``: through
    ``k8s_node_name``; else by its own name, located where the host is listed).

    Ansible's listing does not say where a variable came from, so the files Ansible reads for the
    host are searched in its order of precedence: ``host_vars/HOST*``, the inventory sources,
    ``group_vars/``. Falls back to the inventory's path."""
    base = path if path.is_dir() else path.parent
    setting = re.compile(rf"\b{NODE_VAR}\b\s*[:=]\s*['\"]?{re.escape(node)}(?:['\"\s,}}]|$)")
    mention = re.compile(rf"(?:^|[\s\[\]{{,])['\"]?{re.escape(host)}['\"]?(?:[\s:=,}}]|$)")
    host_files = [p for p in _files(base / "host_vars") if p.name.split(".")[0] == host
                  or p.parent.name == host]
    sources = [path] if path.is_file() else [p for p in _files(path) if not _in_vars_dir(p, path)]
    group_files = list(_files(base / "group_vars"))
    if by_variable:
        for candidates, need_host in ((host_files, False), (sources, True), (sources, False),
                                      (group_files, False)):
            for f in candidates:
                for number, line in _lines(f):
                    m = setting.search(line)
                    if m and (not need_host or mention.search(line[:m.start()])):
                        return Location(str(f), number)
    for f in sources:  # where the host is listed
        for number, line in _lines(f):
            if mention.search(line.split(NODE_VAR)[0]) and not line.lstrip().startswith(("#", ";")):
                return Location(str(f), number)
    return Location(str(path))


def _files(folder: Path) -> Iterator[Path]:
    if not folder.is_dir():
        return
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            yield p


def _in_vars_dir(p: Path, root: Path) -> bool:
    return any(part in ("host_vars", "group_vars") for part in p.relative_to(root).parts[:-1])


def _lines(f: Path) -> Iterator[tuple[int, str]]:
    try:
        if f.stat().st_size > _MAX_SCAN:
            return
        text = f.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    yield from enumerate(text.splitlines(), start=1)


def _where(loc: Location) -> str:
    return f"{loc.path}:{loc.line}"
