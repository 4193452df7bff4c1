"""A real Kubernetes control plane on loopback for tests and `vllm-stack cluster up`.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler are the upstream programs, built from
their Go modules by `make install` (:mod:`vllm_stack_dev.gotools`); kwok plays the kubelets (no container
runtime can run here), so Pods are scheduled by the real scheduler and kwok reports them Running.
"""
