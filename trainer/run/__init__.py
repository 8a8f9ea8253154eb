"""Run guards: what keeps a run honest about how it is going and how it ends.

    watchdog.py     hang detection: a rank without progress for `train.hang_timeout_s` dumps its stacks and exits 124
    heartbeat.py    what the watchdog's beats say: time in steps, restarts, lost steps; how each rank left
    ledger.py       <run dir>/faults.json: goodput, restarts, lost steps, a straggler (torch-free)
    failure.py      <run dir>/faults/rank<N>.json: how a rank failed, and which failure was the cause (torch-free)
    restart.py      after an attempt: restart from the last checkpoint, or end the run (crash loops) (torch-free)
    shared_dirs.py  every rank must see the run and checkpoint directories: checked at start-up
    preempt.py      signals: save at the next step boundary, then leave with a code that says why
    nonfinite.py    a NaN or inf loss or gradient norm: stop, or skip that update
    status.py       <run dir>/status.json, what a run says about itself (torch-free)
"""
