"""Run one `k3 lab` experiment from Python and print the article's claims beside the verdicts.

    python examples/lab_experiment.py recall             # quick mode: minutes on a 2-core CPU
    python examples/lab_experiment.py decode --mode smoke

Results, figures and a results page go to --out (default runs/lab), as `k3 lab NAME` writes them.
"""

import argparse

from k3 import lab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(lab.EXPERIMENTS))
    parser.add_argument("--mode", default="quick", choices=("smoke", "quick", "full"))
    parser.add_argument("--out", default="runs/lab")
    args = parser.parse_args()

    result = lab.run(args.name, args.mode, args.out)
    for claim in result.claims:
        print(f"[{claim.verdict}] {claim.claim}\n    measured: {claim.measured}")
    print(f"{result.seconds:.0f} s; figures: {', '.join(f.path for f in result.figures)}; page: {args.out}/results.md")


if __name__ == "__main__":
    main()
