"""A worker process keeps its database connection between tasks, as the web does between
requests, and replaces one the server killed before the next task's first query."""

from __future__ import annotations

import pytest
from celery.signals import task_postrun, task_prerun
from django.db import connection, connections

import gpushare.celery  # noqa: F401 - connects the task signal handlers
from tests.db_connections import backend_pid, connections_kept


def task(body):
    task_prerun.send(sender=None, task_id="t", task=None)
    try:
        return body()
    finally:
        task_postrun.send(sender=None, task_id="t", task=None)


@pytest.fixture
def persistent_connections(transactional_db):
    with connections_kept(60):
        yield


def test_a_connection_outlives_the_task_and_a_killed_one_is_replaced(persistent_connections):
    first = task(backend_pid)
    assert task(backend_pid) == first  # kept between tasks: no new connection per task
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            # With a timeout, it returns once the backend has exited: without one it only signals, and on a
            # slow machine the next task's health check could still find the backend alive, then lose it.
            cursor.execute("SELECT pg_terminate_backend(%s, 10000)", [first])
            assert cursor.fetchone()[0] is True
    finally:
        other.close()
    replaced = task(backend_pid)  # the health check found it dead: a new one, no error
    assert replaced != first


def test_with_conn_max_age_0_each_task_gets_a_fresh_connection(transactional_db):
    connection.close()
    assert task(backend_pid) != task(backend_pid)
