"""The free ports a Triton server is started on (llmc/triton_server.py): distinct, and never one the caller gave."""

import socket

from llmc.triton_server import Ports, free_ports


def test_ports_drawn_together_are_distinct_and_free():
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:  # each still bindable once drawn
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_server_keeps_the_ports_it_was_given_and_draws_the_others_apart_from_them():
    with socket.socket() as s:  # a free port, as a user might name one
        s.bind(("127.0.0.1", 0))
        given = s.getsockname()[1]
    ports = Ports.free(metrics=given)
    assert ports.metrics == given and len({ports.http, ports.grpc, ports.metrics}) == 3
    assert given not in free_ports(8, avoid=[given])
    assert Ports.free(1, 2, 3) == Ports(1, 2, 3)
