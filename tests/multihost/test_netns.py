"""The simulated hosts themselves (``tests.multihost._netns``): what each host
sees (its name, its hosts file, its interface), that hosts reach one another
through their addresses and names but not through loopback, and that teardown
leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.multihost import _netns
from tests.multihost._launch import base_env
from tests.multihost._netns import NETNS_ETC, SELF_ADDR

_PROBE = """
import json, socket
name = socket.gethostname()
print(json.dumps({
    "hostname": name,
    "fqdn": socket.getfqdn(),
    "resolves": {n: socket.gethostbyname(n) for n in ("node0", "node1", "node2")},
}))
"""

_LISTEN = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 29555))
s.listen()
s.settimeout(20)
print("listening", flush=True)
conn, peer = s.accept()
conn.sendall(peer[0].encode())
"""

_DIAL = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 29555), timeout=3)
    print("ok", c.recv(64).decode())
except OSError as e:
    print("refused" if isinstance(e, ConnectionRefusedError) else f"error {e!r}")
"""


def _namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
    )
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.slow
def test_each_host_sees_its_own_name_and_the_others(sim_hosts):
    import json

    hosts = sim_hosts(3)
    for h in hosts.hosts:
        out = hosts.exec(h, [sys.executable, "-c", _PROBE])
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        assert seen["hostname"] == seen["fqdn"] == h.name, seen
        expected = {o.name: (SELF_ADDR if o is h else o.addr) for o in hosts.hosts}
        assert seen["resolves"] == expected, seen
        link = hosts.exec(h, ["ip", "-4", "-o", "addr", "show", "dev", h.ifname])
        assert f"inet {h.addr}/24" in link.stdout, link.stdout


@pytest.mark.slow
def test_hosts_reach_each_other_by_address_and_name_not_by_loopback(sim_hosts):
    hosts = sim_hosts(2)
    env = base_env()
    server = hosts.popen(
        0, [sys.executable, "-c", _LISTEN], env=env, stdout=subprocess.PIPE
    )
    assert server.stdout.readline().decode().strip() == "listening"
    # host 1's loopback is its own: host 0's listener is not there
    out = hosts.exec(1, [sys.executable, "-c", _DIAL, "127.0.0.1"])
    assert out.stdout.strip() == "refused", (out.stdout, out.stderr)
    # by name: node0 is host 0's address on host 1; the peer is host 1's address
    out = hosts.exec(1, [sys.executable, "-c", _DIAL, "node0"])
    assert out.stdout.strip() == f"ok {hosts[1].addr}", (out.stdout, out.stderr)
    server.wait(timeout=10)


@pytest.mark.slow
def test_teardown_removes_namespaces_files_and_processes(sim_hosts):
    hosts = sim_hosts(2)
    names = {hosts.switch, *(h.netns for h in hosts.hosts)}
    assert names <= _namespaces()
    sleeper = hosts.popen(1, ["sleep", "60"], env=base_env())
    time.sleep(0.2)
    assert sleeper.poll() is None
    hosts.close()
    assert sleeper.poll() is not None  # killed
    assert not names & _namespaces()
    assert not any((NETNS_ETC / n).exists() for n in names)
    hosts.close()  # idempotent


def test_unavailable_says_why(monkeypatch):
    # what the fixture skips with, where namespaces cannot be made
    monkeypatch.setattr(_netns.sys, "platform", "linux")
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    assert _netns.unavailable() == "making network namespaces needs root"
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        _netns.shutil, "which", lambda tool: None if tool == "ip" else "/bin/" + tool
    )
    assert _netns.unavailable() == "`ip` is not installed"
    monkeypatch.setattr(_netns.sys, "platform", "darwin")
    assert _netns.unavailable() == "network namespaces need Linux"


def test_a_failing_ip_command_is_unavailable_with_its_text():
    if _netns.unavailable():
        pytest.skip(_netns.unavailable())
    with pytest.raises(_netns.Unavailable, match="ip link show"):
        _netns._ip("link", "show", "dev", "rd-no-such-interface")


@pytest.mark.slow
def test_namespaces_of_a_killed_session_are_swept():
    # a session killed before its teardown leaves rd-<pid>x...: the next one to
    # make hosts deletes them once that pid is gone and nothing runs inside
    if _netns.unavailable():
        pytest.skip(_netns.unavailable())
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    name = f"rd-{gone.pid}xdead0-host0"
    _netns._ip("netns", "add", name)
    try:
        (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
        assert name in _netns.sweep_stale()
        assert name not in _namespaces()
        assert not (NETNS_ETC / name).exists()
    finally:
        _netns._ip("netns", "delete", name, check=False)
