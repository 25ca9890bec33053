"""Submitting a chain's jobs to Slurm through submitit: `--folder` checked before anything is submitted, each
job made to wait for the one before it (`afterok`), and a submission that fails half-way (sbatch refused a job,
submitit's files not writable) said in one line that names the jobs submitted before it."""

from __future__ import annotations

import contextlib
import io
import os

from megatron_ext.recipe import RecipeError


class SubmissionError(RuntimeError):
    """A job of the chain could not be submitted: one line, saying which jobs were submitted before it."""


class Submitted:
    """The jobs submitted so far, for the line that ends a submission that failed half-way: Slurm runs them as
    submitted (the wording of slurm/pipeline.sh's submit_failed)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str]] = []  # (name, job id)

    def add(self, name: str, job_id: str) -> None:
        self.jobs.append((name, job_id))

    def failed(self, message: str) -> SubmissionError:
        """`message`, then that nothing was launched, or which jobs were and the scancel that cancels them."""
        if not self.jobs:
            return SubmissionError(f"{message}; nothing launched")
        names = ", ".join(f"{name} (job {job})" for name, job in self.jobs)
        return SubmissionError(f"{message}; submitted before it: {names}, which Slurm runs as submitted: scancel "
                               f"{' '.join(job for _, job in self.jobs)} to cancel them")

    def submit(self, executor, name: str, folder: str, function):
        """`executor.submit(function)`, recorded; a refusal of sbatch or a folder it cannot write raises
        SubmissionError (submitit's FailedJobError carried a 30-line traceback, and left the jobs submitted before
        it unsaid)."""
        from submitit.core.utils import FailedJobError

        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr itself before it raises
                job = executor.submit(function)
        except FailedJobError as e:
            code = getattr(e.__cause__, "returncode", None)
            lines = [line.strip().removeprefix("sbatch: error: ") for line in str(e).splitlines()]
            why = "; ".join(line for line in lines if line)
            raise self.failed(f"sbatch refused the {name} job ({why or f'exit {code}'})") from None
        except OSError as e:
            raise self.failed(f"--folder {folder}: cannot write submitit's files for the {name} job there "
                              f"({e.strerror or e}); give a writable folder") from None
        self.add(name, job.job_id)
        return job


def check_submit_folder(folder: str) -> None:
    """RecipeError where submitit cannot make `--folder` (its part before the first `%j`): a file there or above it
    ended the submission in a FileExistsError or NotADirectoryError traceback."""
    from submitit.core.utils import JobPaths

    base = JobPaths.get_first_id_independent_folder(folder).absolute()
    there = base
    while not os.path.lexists(there):
        there = there.parent
    if not there.is_dir():
        where = "is a file" if there == base else f"lies under {there}, which is a file"
        raise RecipeError(f"--folder {folder}: {where}, not a folder; give a folder for submitit's logs and pickles")


def after(params: dict, job: str) -> dict:
    """submitit parameters of a job that starts once job `job` has succeeded, and that Slurm cancels if it fails
    (`--kill-on-invalid-dep`: else it would wait in the queue forever, DependencyNeverSatisfied)."""
    extra = dict(params["additional_parameters"], dependency=f"afterok:{job}", kill_on_invalid_dep="yes")
    return dict(params, additional_parameters=extra)
