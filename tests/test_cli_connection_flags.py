"""`localserve serve`'s connection flags: each phase's bound and the unfinished cap, from the command line
into the server's config; the defaults are PhaseBounds' own (one source), the cap follows
--max-connections unless given."""

from __future__ import annotations

from localserve.cli import build_parser, phase_bounds
from localserve.server.wire.connection_phases import PhaseBounds


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_the_defaults_are_the_phase_bounds_own_and_the_cap_follows_max_connections():
    args = serve_args()
    assert phase_bounds(args) == PhaseBounds()
    assert args.max_connections == 256 and args.max_unfinished_connections is None


def test_every_flag_sets_its_bound():
    args = serve_args("--header-timeout", "2", "--body-gap-timeout", "3", "--min-body-rate", "0",
                      "--keep-alive-timeout", "4", "--handshake-timeout", "5", "--first-event-timeout", "6",
                      "--max-unfinished-connections", "32")
    assert phase_bounds(args) == PhaseBounds(header_s=2, body_gap_s=3, min_body_rate=0, keep_alive_s=4,
                                             handshake_s=5, first_event_s=6)
    assert args.max_unfinished_connections == 32
