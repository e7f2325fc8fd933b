"""What every ``gpulayer`` command shares: exit codes, the CLI's NATS identity, the console,
the connection with its one-line failures, and the request/reply command shape."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console

EXIT_FAILED, EXIT_INVALID, EXIT_UNREACHABLE = 1, 2, 3
# The credential lacks a permission the command needs (NATS refused it, or placement did).
EXIT_DENIED = 4


def nats_settings() -> Any:
    """The CLI's NATS settings (``gpulayer_cli.identity``)."""
    from gpulayer_cli.identity import cli_nats_settings

    return cli_nats_settings(os.environ)


def me() -> str:
    """The name this CLI submits and asks as (its credentials' identity)."""
    from gpulayer_cli.identity import whoami

    return whoami(nats_settings())


def console() -> Console:
    # Piped or redirected output (grep, a log file) is not cut to a guessed 80 columns.
    width = None if sys.stdout.isatty() else 200
    return Console(highlight=False, soft_wrap=True, width=width)


def who(settings: Any) -> str:
    """The credential's identity in words (``user alice``), for permission messages."""
    from gpulayer_cli.denials import describe
    from gpulayer_runtime.auth import identity_of

    if not settings.creds:
        return describe(None)
    identity = identity_of(settings.creds)
    return describe(identity) if identity else f"the credential {settings.creds}"


async def with_nats(fn: Callable[[Any], Awaitable[int]], *, quiet: bool = False) -> int:
    """Connect as the CLI's identity and run ``fn``; failures to connect are one line (none
    with ``quiet``) and exit status 3, a bad setting exit status 2, a permission the credential
    lacks (NATS or placement refused it) exit status 4."""
    import nats.errors

    from gpulayer_cli.client import ApiDenied, ApiFailed, ApiUnavailable
    from gpulayer_cli.denials import Denials, PermissionDenied, watch
    from gpulayer_runtime.auth import AuthError
    from gpulayer_runtime.nats import connect
    from gpulayer_runtime.settings import ConfigError

    def say(text: str) -> None:
        if not quiet:
            print(f"gpulayer: {text}", file=sys.stderr)

    try:
        settings = nats_settings()
        # Also quiet: it reports nothing but permission violations, to the operation they end.
        denials = Denials(who(settings))
    except (ConfigError, AuthError) as err:
        say(str(err))
        return EXIT_INVALID
    url = settings.url
    try:
        nc = await asyncio.wait_for(
            connect(
                url,
                "gpulayer-cli",
                max_reconnect_attempts=0,
                allow_reconnect=False,
                error_cb=denials.on_error,
                **settings.connect_args(),
            ),
            5,
        )
    except nats.errors.Error as err:
        say(_not_connected(url, settings.creds, err))
        return EXIT_UNREACHABLE
    except (OSError, TimeoutError) as err:
        say(f"cannot reach NATS at {url}: {str(err) or 'no server answered'}")
        return EXIT_UNREACHABLE
    watch(nc, denials)
    try:
        return await denials.guard(fn(nc))
    except (PermissionDenied, ApiDenied) as err:
        say(str(err))
        return EXIT_DENIED
    except ApiUnavailable as err:
        print(f"gpulayer: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ApiFailed as err:
        print(f"gpulayer: {err}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await nc.close()


def _not_connected(url: str, creds: str | None, err: Exception) -> str:
    """Why NATS at ``url`` did not take the CLI's connection, in one line."""
    if "authorization" not in str(err).lower():
        return f"cannot reach NATS at {url}: {str(err) or 'no server answered'}"
    if creds:
        return f"NATS at {url} refused the connection: credentials {creds} are not valid there"
    return (
        f"NATS at {url} refused the connection: it needs credentials "
        "(GPULAYER_NATS_CREDS; docs/security.md)"
    )


def api_command(
    subject: str,
    payload: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[Console, Any], None],
) -> Callable[[argparse.Namespace], int]:
    """A command that asks placement's API once and prints the answer (``--json``: as is)."""

    def run(args: argparse.Namespace) -> int:
        from gpulayer_cli.client import api

        async def go(nc: Any) -> int:
            data = await api(nc, subject, payload(args), caller=me())
            if args.json:
                print(json.dumps(data, indent=2, default=str))
            elif getattr(args, "devices", False):
                render(console(), data, True)  # type: ignore[call-arg]
            else:
                render(console(), data)
            return 0

        return asyncio.run(with_nats(go))

    return run


async def known_job(nc: Any, job_id: str) -> dict[str, Any] | None:
    """The stored record of ``job_id``, or None when placement doesn't know it (or can't be
    asked right now: the submit is then queued in JetStream like any other)."""
    from gpulayer_cli.client import ApiFailed, ApiUnavailable, api
    from gpulayer_contracts.subjects import API_JOB

    try:
        record = await api(nc, API_JOB, {"job_id": job_id}, timeout=2.0, caller=me())
    except (ApiFailed, ApiUnavailable):
        return None
    return record if isinstance(record, dict) else None
