"""Adaptation: Ray jobs over agent traces — collect, fine-tune, evaluate and gate, deploy, and the closed loop.

The rule: a job script is what users run by path (`ray job submit --working-dir . -- python adapt/VERB.py ...`); it
parses its arguments and calls one library module, which holds the work and is what tests and other jobs import:

    collect.py  -> collection.py    agent episodes as Ray tasks -> trace shards
    finetune.py -> finetuning.py    Ray Train fine-tuning on traces -> a merged drafter
    evaluate.py -> evaluation.py    held-out replay, general benchmarks, the gate
    deploy.py   -> deployment.py    swap into a running server, live check, roll-back
    loop.py     -> cycle.py         one iteration of all of it, on a schedule

`demo.py` (`make demo`) runs it all once on this machine; `cluster.py` starts and stops the Ray head it uses.
"""
