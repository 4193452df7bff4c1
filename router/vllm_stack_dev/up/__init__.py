"""`vllm-stack up -f values.yaml`: the chart's own rendering of a values file, run as local processes.

``render`` asks Helm for the objects (so a values file is refused here exactly as ``helm install``
refuses it), ``plan`` turns them into command lines and says what it had to change to run them on this
machine, and ``run`` starts, watches and stops the processes.
"""
