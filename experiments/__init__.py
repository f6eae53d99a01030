"""Studies that compare attention kinds under the project's protocol (docs/design.md §7).

`python -m experiments.run STUDY [--scale tiny|small|paper] [--seeds N] [--out DIR]`.
"""
