"""The build: the stages in order, run over a spec, and the plan of a build.

    stages.py  the table: the stages, declared with the code that does their work, in the order they run
    run.py     `build`: run the table, reuse what is unchanged (the cache key), publish atomically
    plan.py    `plan_build` (`llmc build --dry-run`): what a build would make, from the config alone
"""
