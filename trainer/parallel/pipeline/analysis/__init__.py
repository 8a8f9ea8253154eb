"""The pipeline's offline tools, torch-free: the simulator, several steps on its clock, the timeline picture,
the checks every schedule passes, its in-flight activation count, the balanced stage split, and the schedule
costs a run measured. `mantra plan` and the tests use them; the runtime beside this folder trains with the
schedules."""
