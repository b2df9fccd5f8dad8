"""The test Redis is real, persists through kill -9, and starts clean for each test."""

from __future__ import annotations

import redis

from batchgen.jobs.redis.redis_server import RedisServer


def test_private_server_keeps_aof_data_through_kill_and_restart(private_redis: RedisServer):
    client = redis.Redis.from_url(private_redis.url)
    client.set("k", "v")
    for i in range(1000):
        client.xadd("s", {"i": i})
    assert private_redis.process is not None
    pid = private_redis.process.pid
    private_redis.kill()
    try:
        client.ping()
        raise AssertionError("server still answers after kill -9")
    except redis.ConnectionError:
        pass
    private_redis.start()
    assert private_redis.process is not None and private_redis.process.pid != pid
    client = redis.Redis.from_url(private_redis.url)
    assert client.get("k") == b"v"
    assert client.xlen("s") == 1000
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("appendfsync") == {"appendfsync": "always"}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}


def test_without_aof_data_is_gone_after_kill(tmp_path):
    server = RedisServer(tmp_path, appendonly=False)
    server.start()
    try:
        redis.Redis.from_url(server.url).set("k", "v")
        server.restart()
        assert redis.Redis.from_url(server.url).get("k") is None
    finally:
        server.kill()


def test_shared_server_first_test_writes(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("leftover", 1)


def test_shared_server_is_flushed_between_tests(redis_url: str):
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_unix_socket_server(tmp_path):
    server = RedisServer(tmp_path, unix_socket=tmp_path / "r.sock")
    server.start()
    try:
        assert server.url == f"unix://{tmp_path / 'r.sock'}"
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.kill()
