"""A TCP relay: `python -m ddp_harness.tcp_relay LISTEN_HOST:PORT TARGET_HOST:PORT`.

The local apiserver listens on loopback only. Pods reach it through the `kubernetes` Service, whose
endpoint is this relay on the real node's bridge address: bytes are copied both ways unchanged, so TLS
and client-certificate authentication stay end to end between the pod and the apiserver."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

_CHUNK = 64 * 1024


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _handle(
    target: tuple[str, int], client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(*target)
    except OSError:
        client_writer.close()
        return
    try:
        await asyncio.gather(_pump(client_reader, upstream_writer), _pump(upstream_reader, client_writer))
    finally:
        for w in (client_writer, upstream_writer):
            w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


async def serve(listen: tuple[str, int], target: tuple[str, int], ready: asyncio.Event | None = None) -> None:
    """Relay every connection to listen until cancelled (or SIGTERM/SIGINT when run as a program)."""
    server = await asyncio.start_server(lambda r, w: _handle(target, r, w), *listen, reuse_address=True)
    async with server:
        if ready is not None:
            ready.set()
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(
            "usage: python -m ddp_harness.tcp_relay LISTEN_HOST:PORT TARGET_HOST:PORT",
            file=sys.stderr,
        )
        return 2
    try:
        listen, target = parse_address(argv[0]), parse_address(argv[1])
    except ValueError as exc:
        print(f"tcp_relay: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(listen, target)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
