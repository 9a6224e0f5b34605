"""Simulated hosts on one machine: a network namespace per host, joined by a bridge.

What a test gets from :class:`SimHosts` (``n`` hosts):

* host ``K`` is the network namespace ``rd-<tag>-hostK``: its own loopback (up),
  its own ports, and one interface named ``rd0`` (the same name on every host, as
  ``eth0`` is on the nodes of a cluster) with the address ``10.77.<net>.<K+1>/24``;
* the ``rd0`` interfaces are veth ends whose peers sit on a bridge in a
  "switch" namespace ``rd-<tag>-sw``: nothing of it is in the machine's own
  namespace, so no traffic can leave the simulated hosts, and the machine's own
  interfaces, routes and ports are untouched;
* per-host name resolution: ``/etc/netns/<namespace>/hosts``. On host ``K`` its
  own node name ``nodeK`` maps to ``127.0.1.1`` (what Debian and Ubuntu write for
  a machine's own name) and every other node name to that node's address.
  ``ip netns exec`` bind-mounts that file over ``/etc/hosts`` for the commands it
  runs (checked on this machine); :meth:`SimHosts.popen` does not rely on it: it
  runs the command in a mount namespace of its own (``unshare --mount``, private
  propagation, so nothing shows outside) where it bind-mounts the file itself,
  and :meth:`SimHosts.create` checks that a host sees its own file;
* per-host host name: the same ``unshare`` makes a UTS namespace whose host name
  is ``nodeK`` (``hostname``), so ``socket.gethostname()``/``getfqdn()`` -- what
  torchrun's c10d rendezvous hands its workers as ``MASTER_ADDR`` -- say
  ``nodeK`` there.

Teardown (:meth:`SimHosts.close`, idempotent, run by the fixture whatever the
test did): every process this object started is killed (its process group), then
any process still inside one of the namespaces (``ip netns pids``: only
descendants of ours can be there), then the namespaces are deleted (which deletes
their interfaces) and the hosts files removed. A namespace left by a killed test
session (``rd-<pid>x...`` whose ``pid`` is gone and which holds no process) is
removed the next time hosts are made.

:func:`unavailable` says why simulated hosts cannot be made here (not Linux, not
root, no ``ip``/``unshare``/``hostname``/``mount``, or making a namespace, its
interfaces or its own view of ``/etc/hosts`` fails); the fixture skips with that
reason.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Host", "SimHosts", "Unavailable", "unavailable"]

IFNAME = "rd0"
"""The interface name of every simulated host (like ``eth0`` on every node)."""
SELF_ADDR = "127.0.1.1"
"""What a host's own node name resolves to on that host (the Debian default)."""
NETNS_ETC = Path("/etc/netns")
CMD_TIMEOUT_S = 10.0
"""Bound on each ``ip`` command."""

_PREFIX = "rd-"
_COUNTER = itertools.count()


class Unavailable(RuntimeError):
    """Simulated hosts cannot be made on this machine (the reason is the text)."""


@dataclass(frozen=True)
class Host:
    index: int
    name: str
    """The node name (``nodeK``): the host name inside, resolvable everywhere."""
    netns: str
    addr: str
    """The address of its ``rd0`` interface."""
    ifname: str = IFNAME


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if check and proc.returncode != 0:
        raise Unavailable(
            f"`ip {' '.join(args)}` failed ({proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or None where they can (checked
    without making anything; :meth:`SimHosts.create` may still fail)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "hostname", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(netns: str) -> list[int]:
    proc = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier sessions that were killed before their
    teardown: named by this module, owner process gone, no process inside."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    pattern = re.compile(rf"^{re.escape(_PREFIX)}(\d+)x[0-9a-f]+-(host\d+|sw)$")
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = pattern.match(name)
        if not m or _pid_alive(int(m.group(1))) or _netns_pids(name):
            continue
        _ip("netns", "delete", name, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        removed.append(name)
    return removed


class SimHosts:
    """``n`` simulated hosts (see the module's doc). Use as a context manager, or
    call :meth:`create` and, always, :meth:`close`."""

    def __init__(self, n: int, *, net: int | None = None) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"1 to 200 hosts, not {n}")
        self.n = n
        self.tag = f"{os.getpid()}x{secrets.token_hex(2)}{next(_COUNTER)}"
        self.net = net if net is not None else 1 + secrets.randbelow(254)
        self.switch = f"{_PREFIX}{self.tag}-sw"
        self.hosts = [
            Host(
                k,
                f"node{k}",
                f"{_PREFIX}{self.tag}-host{k}",
                f"10.77.{self.net}.{k + 1}",
            )
            for k in range(n)
        ]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False

    def __enter__(self) -> SimHosts:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, k: int) -> Host:
        return self.hosts[k]

    def __len__(self) -> int:
        return self.n

    # -- set-up
    def create(self) -> None:
        why = unavailable()
        if why:
            raise Unavailable(why)
        sweep_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        self._netns_add(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            self._netns_add(h.netns)
            # both ends are made inside the switch (no interface ever appears in
            # the machine's own namespace), then one end moves to the host
            port, end = f"p{h.index}", f"h{h.index}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", end)  # fmt: skip
            _ip("-n", self.switch, "link", "set", end, "netns", h.netns)
            _ip("-n", h.netns, "link", "set", end, "name", h.ifname)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            self._write_hosts(h)
        self._check_view(self.hosts[-1])

    def _check_view(self, h: Host) -> None:
        """A command on ``h`` sees its host name and its hosts file."""
        try:
            out = self.exec(h, ["sh", "-c", "hostname && cat /etc/hosts"])
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(
                f"running a command on a simulated host failed: {exc}"
            ) from exc
        lines = out.stdout.splitlines()
        if out.returncode != 0 or not lines or lines[0] != h.name:
            raise Unavailable(
                f"a command on a simulated host did not get its own host name "
                f"(`unshare --uts`, `hostname`): {out.stdout!r} {out.stderr.strip()!r}"
            )
        if f"{SELF_ADDR}\t{h.name}" not in lines:
            raise Unavailable(
                "a command on a simulated host did not see its own /etc/hosts "
                f"(`unshare --mount`, `mount --bind`): {out.stderr.strip()!r}"
            )

    def _write_hosts(self, h: Host) -> None:
        lines = ["127.0.0.1\tlocalhost"]
        for other in self.hosts:
            addr = SELF_ADDR if other is h else other.addr
            lines.append(f"{addr}\t{other.name}")
        d = NETNS_ETC / h.netns
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("\n".join(lines) + "\n")

    # -- processes
    def popen(
        self,
        host: Host | int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None = None,
        stdout=None,
        stderr=None,
    ) -> subprocess.Popen:
        """Start ``argv`` on ``host``: in its network namespace, in new mount and
        UTS namespaces (its hosts file bind-mounted over ``/etc/hosts``, its host
        name set), in a new session (its process group is killed at
        :meth:`close` or by :meth:`stop`)."""
        h = self.hosts[host] if isinstance(host, int) else host
        hosts_file = NETNS_ETC / h.netns / "hosts"
        cmd = [
            "ip", "netns", "exec", h.netns,
            "unshare", "--mount", "--uts", "--",
            "sh", "-c",
            'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
            h.name, str(hosts_file), *argv,
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            env=dict(env),
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def exec(
        self, host: Host | int, argv: Sequence[str], *, timeout: float = CMD_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command on ``host`` and wait for it (bounded)."""
        proc = self.popen(
            host, argv, env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise
        return subprocess.CompletedProcess(
            proc.args, proc.returncode, out.decode(), err.decode()
        )

    @staticmethod
    def stop(proc: subprocess.Popen, grace: float = 0.0) -> None:
        """Kill ``proc``'s process group (after ``grace`` seconds of SIGTERM)."""
        if proc.poll() is None and grace > 0:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    # -- teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            self.stop(proc)
        for name in self._made:
            # anything still inside (e.g. a torchrun worker in a session of its
            # own) descends from a process this object started
            for _ in range(3):
                pids = _netns_pids(name)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
        for name in reversed(self._made):
            _ip("netns", "delete", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        self._made.clear()
