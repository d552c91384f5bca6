"""A local server started on a port picked as free answers as itself, never as whatever took that port between the
pick and its bind (two test processes at once did: a `rclone serve s3` fixture got a port a fault proxy bound first,
so its tests talked to the proxy's moto server, and failed with the proxy's 403)."""

from __future__ import annotations

import shutil
import socket

import pytest

import tests.rclone
from hsx.pids import gone
from hsx.redisconn import LocalRedis, PortTaken, connect
from tests.ports import listens
from tests.rclone import RcloneS3


def test_a_local_redis_whose_picked_port_is_taken_picks_another_and_answers_as_itself(tmp_path):
    first = LocalRedis(tmp_path / "first").start()
    second = LocalRedis(tmp_path / "second")
    second.port = first.port            # as if the pick had raced the first server's bind
    try:
        second.start()
        assert second.port != first.port
        assert connect(second.url).info("server")["process_id"] == second.proc.pid
        connect(second.url).set("mine", 1)
        assert connect(first.url).get("mine") is None
    finally:
        second.stop()
        first.stop()


def test_a_local_redis_on_a_port_given_and_taken_says_who_holds_it(tmp_path):
    first = LocalRedis(tmp_path / "first").start()
    try:
        with pytest.raises(PortTaken, match=rf"port {first.port}: another process \(pid {first.proc.pid}\)"):
            LocalRedis(tmp_path / "second", port=first.port).start()
    finally:
        first.stop()


def test_rclone_on_a_taken_port_starts_again_on_another(tmp_path, monkeypatch):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    picks = iter([taken])
    real = tests.rclone.free_port
    monkeypatch.setattr(tests.rclone, "free_port", lambda: next(picks, None) or real())
    server = RcloneS3(tmp_path / "root", tmp_path / "rclone.log", keys=("k", "s"))
    try:
        server.start()
        assert server.port != taken and listens(server.proc.pid, server.port)
        assert not listens(server.proc.pid, taken)
    finally:
        server.stop()
        holder.close()


def test_a_local_redis_started_through_a_wrapper_is_its_own(tmp_path):
    """HSX_REDIS_SERVER may name a script that starts redis-server as its child: the server answering is the
    wrapper's descendant, so it is this LocalRedis's own, and stopping it stops that child too (not the wrapper
    alone, which would leave the server holding its port and data)."""
    wrapper = tmp_path / "redis-wrapper"
    wrapper.write_text(f'#!/bin/sh\n"{shutil.which("redis-server")}" "$@"\n')
    wrapper.chmod(0o755)
    server = LocalRedis(tmp_path / "data", binary=str(wrapper)).start()
    pid = connect(server.url).info("server")["process_id"]
    try:
        assert pid != server.proc.pid and server.server_pid == pid   # the child answers, not the wrapper
    finally:
        server.stop()
    assert gone(pid)   # exited (or a zombie its new parent has yet to reap)
