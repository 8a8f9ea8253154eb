"""Run guards: what keeps a run honest about how it is going and how it ends.

    watchdog.py    hang detection: a rank without progress for `train.hang_timeout_s` dumps its stacks and exits 124
    preempt.py     signals: save at the next step boundary, then leave with a code that says why
    nonfinite.py   a NaN or inf loss or gradient norm: stop, or skip that update
    status.py      <run dir>/status.json, what a run says about itself (torch-free)
"""
