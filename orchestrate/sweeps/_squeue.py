"""submitit's Slurm watcher, able to ask `squeue` instead of `sacct` (which answers only where the
cluster keeps accounting): for a `submitit_slurm` sweep, see orchestrate.sweeps.slurm."""

import logging
import subprocess
import time

from submitit.slurm.slurm import SlurmInfoWatcher

log = logging.getLogger("orchestrate.sweeps.slurm")  # routed with it to the sweep's submitit.log
COMMAND_TIMEOUT_S = 60
ENDED = "ENDED"  # the state of a job the controller no longer lists: it ended (MinJobAge, 300 s by default, ago)


class QueueWatcher(SlurmInfoWatcher):
    """submitit's Slurm watcher (a job's state, polled at growing intervals, cached once final),
    asking `squeue` instead of `sacct` when `squeue` is set. `squeue` lists a job until MinJobAge
    after its end; a job it no longer lists has ended (state ENDED): its result file, or its
    absence, says how."""

    def __init__(self, delay_s: int, squeue: bool):
        super().__init__(delay_s=delay_s)
        self.squeue = squeue

    def update(self) -> None:
        if not self.squeue:
            return super().update()
        unfinished = sorted(self._registered - self._finished)
        if not unfinished:
            return
        self._num_calls += 1
        self._last_status_check = time.time()  # failed or not: asked again at the next poll, not at once
        jobs = sorted({job_id.split("_")[0] for job_id in unfinished})  # an array's tasks are asked by its id
        command = ["squeue", "--array", "--states=all", "--format=%i|%T|%N", f"--jobs={','.join(jobs)}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning(f"{' '.join(command)}: {e}; the jobs' states are asked again at the next poll")
            return
        # One job id the controller no longer knows is an error; several, an empty list.
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            log.warning(f"{' '.join(command)} exited {done.returncode} ({done.stderr.strip()}); the jobs' "
                        "states are asked again at the next poll")
            return
        listed = self.read_info("JobID|State|NodeList\n" + "".join(done.stdout.splitlines(True)[1:]))
        for job_id in unfinished:
            listed.setdefault(job_id, {"JobID": job_id, "State": ENDED})
        self._info_dict.update(listed)
        for job_id in unfinished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def unfinished(self) -> list[str]:
        """The registered jobs that have not ended, asked now."""
        self.update_if_long_enough(mode="force")
        return sorted(job_id for job_id in self._registered if not self.is_done(job_id, mode="cache"))
