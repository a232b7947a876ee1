"""`tollway profile`: time the real runner over a grid of steps on this machine (or estimate a
named GPU's from its specs) and write the machine profile the simulator runs on."""
from __future__ import annotations

import os
import sys

from tollway.engine_arguments import add_engine_arguments, engine_config
from tollway.sim.hardware import HARDWARE, estimated_profile

DEFAULT_PROFILE = "tollway-profile.json"


def add_parser(sub) -> None:
    profile = sub.add_parser("profile", help="time the real runner over a grid of steps (or estimate a named "
                                             "GPU's) and write the machine profile the simulator runs on")
    profile.add_argument("--hardware", help="estimate from specs instead of measuring: " + ", ".join(HARDWARE))
    profile.add_argument("--output", default=DEFAULT_PROFILE, help=f"the profile JSON (default {DEFAULT_PROFILE})")
    profile.add_argument("--usd-per-hour", type=float, help="one replica's price, kept in the profile")
    profile.add_argument("--quick", action="store_true", help="a small grid (for a first look)")
    profile.add_argument("--from", dest="from_url", metavar="URL",
                         help="fit the profile to a running tollway server's own steps instead (its /dashboard/steps, "
                              "after it has served traffic): the machine as it is now, with the server's own work")
    profile.add_argument("--admin-key", help="with --from: the server's admin key (default $TOLLWAY_API_KEY)")
    add_engine_arguments(profile)


def profile_main(args) -> int:
    if args.hardware and args.from_url:
        raise ValueError("profile: give --hardware or --from, not both")
    if args.hardware:
        profile = estimated_profile(args.hardware, args.model or "gemma3-270m")
    elif args.from_url:
        profile = _served_profile(args.from_url, args.admin_key or os.environ.get("TOLLWAY_API_KEY"))
    else:
        from tollway.engine import Engine
        from tollway.model.machine_profiler import Grid, measure

        config = engine_config(args)
        config.profile_steps = False  # the grid below is the profile
        grid = Grid(decodes=(1, 8, 32), contexts=(128, 512), prefills=(0, 64), repeats=1, jitter_repeats=6) \
            if args.quick else Grid()
        profile = measure(Engine(config), grid)
    if args.usd_per_hour is not None:
        profile.usd_per_hour = args.usd_per_hour
    profile.save(args.output)
    kind = "estimated" if profile.estimate else "measured"
    drift = None if profile.estimate else profile.drift()
    print(f"tollway profile: {kind} {len(profile.samples)} steps on {profile.hardware}; wrote {args.output}"
          + ("" if drift is None else f"; the machine drifted {drift:+.1%} from the first half of the steps to the "
                                      "second" + (" (more than 5%: its step times are not steady)" if abs(drift) > 0.05
                                                  else "")), file=sys.stderr)
    return 0


def _served_profile(url: str, key: str | None):
    import httpx

    from tollway.sim.live_profile import live_profile

    root = url.rstrip("/").removesuffix("/v1")  # the server's root, as users often give .../v1
    source = root + "/dashboard/steps"
    try:
        response = httpx.get(source, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)
    except httpx.HTTPError as e:
        raise ValueError(f"profile --from: cannot reach {source}: {e}") from None
    if response.status_code != 200:
        raise ValueError(f"profile --from: {source} answered {response.status_code} "
                         f"({response.text[:200]}); an admin key may be needed (--admin-key)")
    return live_profile(response.json(), url)
