"""Probe values for production-stack's keys (tests/helm/test_production_stack_keys.py): where the key's default
is empty or its perturbation would be no valid value, a realistic one; and the settings a block needs to
render at all in both charts."""

from __future__ import annotations

TOLERATION = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
TERMS = [{"matchExpressions": [{"key": "node-role", "operator": "In", "values": ["gpu"]}]}]
ENV = [{"name": "PROBE", "value": "1"}]
MOUNTS = [{"name": "probe", "mountPath": "/probe"}]
VOLUMES = [{"name": "probe", "emptyDir": {}}]
HTTP_PROBE = {"path": "/ping"}
PORTS = [{"name": "probe", "port": 9001, "targetPort": 9001, "protocol": "TCP"}]
RELABEL = [{"action": "replace", "targetLabel": "team", "replacement": "probe"}]

OVERRIDES = {
    "cacheserverSpec.imagePullSecrets": [{"name": "regcred"}],
    "cacheserverSpec.resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
    "cacheserverSpec.serde": "cachegen",
    "cacheserverSpec.tolerations": TOLERATION,
    "cacheserverSpec.affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": TERMS}}
    },
    "cacheserverSpec.nodeSelector": {"pool": "cache"},
    "extraObjects": [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}}],
    "routerSpec.env": ENV,
    "routerSpec.extraArgs": ["--log-level", "debug"],
    "routerSpec.extraPorts": PORTS,
    "routerSpec.rootPath": "/vllm",  # a path (production-stack's example); the default probe is no path
    "routerSpec.extraVolumeMounts": MOUNTS,
    "routerSpec.extraVolumes": VOLUMES,
    "routerSpec.imagePullSecrets": [{"name": "regcred"}],
    "routerSpec.ingress.hosts.[].host": "llm.example.com",
    "routerSpec.ingress.hosts.[].paths.[].path": "/v1",
    "routerSpec.ingress.hosts.[].paths.[].pathType": "Exact",
    "routerSpec.ingress.tls": [{"hosts": ["llm.example.com"], "secretName": "tls"}],
    "routerSpec.livenessProbe.httpGet": HTTP_PROBE,
    "routerSpec.readinessProbe.httpGet": HTTP_PROBE,
    "routerSpec.startupProbe.httpGet": HTTP_PROBE,
    "routerSpec.nodePort": 30081,
    "routerSpec.nodeSelectorTerms": TERMS,
    "routerSpec.pdb.maxUnavailable": 1,
    "routerSpec.pdb.minAvailable": 1,
    "routerSpec.resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}},
    "routerSpec.route.main.additionalRules": [{"backendRefs": [{"name": "other", "port": 80}]}],
    "routerSpec.route.main.annotations": {"probe": "x"},
    "routerSpec.route.main.apiVersion": "gateway.networking.k8s.io/v1beta1",
    "routerSpec.route.main.filters": [
        {
            "type": "RequestHeaderModifier",
            "requestHeaderModifier": {"add": [{"name": "x-probe", "value": "1"}]},
        }
    ],
    "routerSpec.route.main.hostnames": ["llm.example.com"],
    "routerSpec.route.main.kind": "GRPCRoute",
    "routerSpec.route.main.labels": {"probe": "x"},
    "routerSpec.route.main.parentRefs": [{"name": "other-gateway"}],
    "routerSpec.route.main.matches.[].path.value": "/v1",
    "routerSpec.serviceMonitor.interval": "60s",
    "routerSpec.serviceMonitor.scrapeTimeout": "20s",
    "routerSpec.serviceMonitor.metricRelabelings": RELABEL,
    "routerSpec.serviceMonitor.relabelings": RELABEL,
    "routerSpec.hf_token": "hf_probe",
    "routerSpec.vllmApiKey.secretName": "router-key",
    "servingEngineSpec.extraPorts": PORTS,
    "servingEngineSpec.livenessProbe.httpGet": HTTP_PROBE,
    "servingEngineSpec.readinessProbe.httpGet": HTTP_PROBE,
    "servingEngineSpec.startupProbe.httpGet": HTTP_PROBE,
    "servingEngineSpec.serviceMonitor.interval": "60s",
    "servingEngineSpec.serviceMonitor.scrapeTimeout": "20s",
    "servingEngineSpec.serviceMonitor.metricRelabelings": RELABEL,
    "servingEngineSpec.serviceMonitor.relabelings": RELABEL,
    "servingEngineSpec.tolerations": TOLERATION,
    "servingEngineSpec.configs": {"VLLM_LOGGING_LEVEL": "DEBUG"},
    "servingEngineSpec.vllmApiKey.secretName": "engine-key",
    "servingEngineSpec.modelSpec.[].env": ENV,
    "servingEngineSpec.modelSpec.[].envFromSecret": {"name": "s3"},
    "servingEngineSpec.modelSpec.[].extraVolumeMounts": MOUNTS,
    "servingEngineSpec.modelSpec.[].extraVolumes": VOLUMES,
    "servingEngineSpec.modelSpec.[].hf_token.secretName": "hf",
    "servingEngineSpec.modelSpec.[].initContainer.args": ["echo", "probe"],
    "servingEngineSpec.modelSpec.[].initContainer.command": ["sh", "-c"],
    "servingEngineSpec.modelSpec.[].initContainer.env": ENV,
    "servingEngineSpec.modelSpec.[].initContainer.extraVolumeMounts": MOUNTS,
    "servingEngineSpec.modelSpec.[].initContainer.image": "alpine:3",
    "servingEngineSpec.modelSpec.[].initContainer.name": "init-probe",
    "servingEngineSpec.modelSpec.[].initContainer.resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
    "servingEngineSpec.modelSpec.[].nodeSelectorTerms": TERMS,
    "servingEngineSpec.modelSpec.[].resources": {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
    },
    "servingEngineSpec.modelSpec.[].tolerations": TOLERATION,
    "servingEngineSpec.modelSpec.[].tolerationsPolicy": "override",
    "servingEngineSpec.modelSpec.[].vllmConfig.dtype": "half",
    "servingEngineSpec.modelSpec.[].vllmConfig.gpuMemoryUtilization": 0.8,
    "servingEngineSpec.modelSpec.[].vllmConfig.tensorParallelSize": 2,
    "servingEngineSpec.modelSpec.[].pvcStorage": "30Gi",
    "servingEngineSpec.modelSpec.[].affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": TERMS}}
    },
    "servingEngineSpec.modelSpec.[].keda.triggers.type": "prometheus",
    "sharedPvcStorage.hostPath": "/mnt/models",
    "sharedPvcStorage.nfs.server": "nfs.example",
    "sharedPvcStorage.nfs.path": "/exports/models",
}

# What a block needs to render at all, in both charts (a key prefix -> [(path, value)]).
EXTRA = {
    "routerSpec.route.main": [("routerSpec.route.main.parentRefs", [{"name": "gateway"}])],
    "servingEngineSpec.modelSpec.[].initContainer": [
        ("servingEngineSpec.modelSpec.[].initContainer.name", "init"),
        ("servingEngineSpec.modelSpec.[].initContainer.image", "busybox:1.37"),
        ("servingEngineSpec.modelSpec.[].pvcStorage", "10Gi"),
    ],
    "servingEngineSpec.modelSpec.[].keda.triggers": [
        (
            "servingEngineSpec.modelSpec.[].keda.triggers",
            {
                "type": "prometheus",
                "metadata": {
                    "serverAddress": "http://prom:9090",
                    "query": "vllm:num_requests_waiting",
                    "threshold": "5",
                },
            },
        )
    ],
    "servingEngineSpec.modelSpec.[].lmcacheConfig": [
        ("servingEngineSpec.modelSpec.[].vllmConfig", {"enablePrefixCaching": True})
    ],
    "servingEngineSpec.modelSpec.[].vllmConfig": [
        ("servingEngineSpec.modelSpec.[].vllmConfig.enablePrefixCaching", True)
    ],
    "servingEngineSpec.modelSpec.[].vllmConfig.tensorParallelSize": [
        ("servingEngineSpec.modelSpec.[].requestGPU", 2)
    ],
    "servingEngineSpec.modelSpec.[].hf_token.secretKey": [
        ("servingEngineSpec.modelSpec.[].hf_token.secretName", "hf")
    ],
    "servingEngineSpec.modelSpec.[].hf_token.secretName": [
        ("servingEngineSpec.modelSpec.[].hf_token.secretKey", "token")
    ],
    "servingEngineSpec.vllmApiKey.secretKey": [("servingEngineSpec.vllmApiKey.secretName", "engine-key")],
    "servingEngineSpec.vllmApiKey.secretName": [("servingEngineSpec.vllmApiKey.secretKey", "key")],
    "routerSpec.vllmApiKey.secretKey": [("routerSpec.vllmApiKey.secretName", "router-key")],
    "routerSpec.vllmApiKey.secretName": [("routerSpec.vllmApiKey.secretKey", "key")],
    "routerSpec.serviceDiscovery": [
        ("routerSpec.staticBackends", "http://engine:8000"),
        ("routerSpec.staticModels", "org/m"),
    ],
    "routerSpec.routingLogic": [("routerSpec.sessionKey", "x-user")],
    "routerSpec.nodePort": [("routerSpec.serviceType", "NodePort")],
    "sharedPvcStorage": [("sharedPvcStorage.enabled", True)],
    "sharedPvcStorage.nfs.path": [("sharedPvcStorage.nfs.server", "nfs.example")],
    "sharedPvcStorage.nfs.server": [("sharedPvcStorage.nfs.path", "/exports/models")],
}
OVERRIDES |= {
    "loraAdapters.[].baseModel": "m",
    "loraAdapters.[].adapterSource.type": "huggingface",
    "servingEngineSpec.modelSpec.[].keda.minReplicaCount": 2,
    "servingEngineSpec.modelSpec.[].repository": "lmcache/vllm-openai",
    "servingEngineSpec.modelSpec.[].requestCPU": 6,
    "servingEngineSpec.modelSpec.[].requestMemory": "24Gi",
}
EXTRA |= {
    "loraAdapters.[].adapterSource.type": [("loraAdapters.[].adapterSource.repository", "org/adapter")],
    "servingEngineSpec.modelSpec.[].keda": [("servingEngineSpec.modelSpec.[].keda.maxReplicaCount", 5)],
}
EXTRA |= {
    "sharedPvcStorage": [
        ("sharedPvcStorage.enabled", True),
        ("servingEngineSpec.modelSpec.[].pvcStorage", "10Gi"),
    ]
}

# Fields production-stack's rendering changes for a key that this chart renders otherwise on purpose, each
# with the reason (helm/README.md "Coming from production-stack"): key prefix -> {field pattern: reason}.
# A pattern matches a changed field's path ("Kind/name/field/..."). "*" applies to every key.
EQUIVALENT = {
    "*": {
        "env/PROMETHEUS_MULTIPROC_DIR": "production-stack sets /tmp whenever vllmConfig is given; vLLM makes a "
        "private directory itself when it is unset, and the chart renders vllmConfig.prometheusMultiprocDir",
    },
    "cacheserverSpec": {
        "containers/main/argv/#0": "the image's PATH finds lmcache_server (production-stack names /opt/venv/bin/)",
        "livenessProbe/exec": "lmcache_server speaks raw TCP: the chart probes its port (production-stack runs a "
        "script at a path of its own image)",
        "containers/main/image": "the cache server's default tag is the chart's pin (v0.5.6), production-stack's latest",
    },
    "grafanaDashboards": {
        "grafana-vllm-": "production-stack's own dashboards; this chart ships its own, with the same labels and "
        "annotations (tests/helm/test_production_stack_keys.py::test_dashboard_labels_and_annotations)",
    },
    "loraAdapters": {
        "LoraAdapter/": "production-stack's LoRA operator resource; the router's adapter registry takes the entry "
        "(tests/helm/test_lora_adapters.py)",
    },
    "routerSpec.autoscaling": {},
    "routerSpec.hf_token": {
        "env/HF_TOKEN/value": "kept in the chart's Secret (key router_hf_token), read by secretKeyRef",
    },
    "routerSpec.pdb.enabled": {
        "spec/minAvailable": "without minAvailable or maxUnavailable production-stack renders minAvailable 0 (no "
        "protection); this chart keeps one router replica available (maxUnavailable 1)",
    },
    "routerSpec.tag": {
        "containers/main/image": "the tag applies to the image that runs: this chart's router (production-stack's "
        "default repository, lmcache/lmstack-router, takes other flags)",
    },
    "routerSpec.serviceMonitor": {
        "endpoints/#0/interval": "this chart's default interval is monitoring.serviceMonitor.interval, 15s "
        "(production-stack's 30s), so that KEDA's queries see fresh values",
        "endpoints/#0/scrapeTimeout": "without one Prometheus times out at the interval (production-stack: 25s)",
    },
    "servingEngineSpec.serviceMonitor": {
        "endpoints/#0/interval": "this chart's default interval is monitoring.serviceMonitor.interval, 15s "
        "(production-stack's 30s), so that KEDA's queries see fresh values",
        "endpoints/#0/scrapeTimeout": "without one Prometheus times out at the interval (production-stack: 25s)",
    },
    "servingEngineSpec.labels": {
        "argv/--k8s-label-selector": "the router discovers this release's engines by release and component "
        "(tests/helm/test_production_stack_names.py::test_the_router_discovers_every_engine_of_its_release)",
    },
    "servingEngineSpec.modelSpec.[].initContainer": {
        "initContainers/init-probe/securityContext": "servingEngineSpec.containerSecurityContext: this chart's "
        "default drops every capability (production-stack's: runAsNonRoot false)",
    },
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enabled": {
        "env/LMCACHE_USE_EXPERIMENTAL": "LMCache 0.5 has no such setting (tests/helm/test_lmcache_env.py)",
        "env/VLLM_RPC_TIMEOUT": "vLLM reads it only up to 0.22.1 (files/vllm-flags.yaml)",
        "env/LMCACHE_LOG_LEVEL": "LMCache's own default is INFO; lmcacheConfig.logLevel renders it",
        "env/LMCACHE_LMCACHE_INSTANCE_ID": "set (the pod name) where a controller asks for it; LMCache makes one otherwise",
    },
    "servingEngineSpec.modelSpec.[].repository": {
        "containers/main/argv/#0": "the image's PATH finds vllm in both images (tests/helm/test_engine_image.py); "
        "production-stack names /opt/venv/bin/vllm for lmcache/vllm-openai",
    },
    "servingEngineSpec.modelSpec.[].keda.triggers.metadata.query": {
        "triggers/#0/metadata/query": "a bare metric name is scoped to the model and summed to one element (KEDA "
        "wants one); NOTES says so",
    },
    "servingEngineSpec.modelSpec.[].name": {
        "livenessProbe/initialDelaySeconds": "the startup probe gates the liveness and readiness probes, which "
        "begin once it succeeded (production-stack delays them 15 s instead)",
        "readinessProbe/initialDelaySeconds": "the startup probe gates the liveness and readiness probes, which "
        "begin once it succeeded (production-stack delays them 15 s instead)",
        "ports/55555": "production-stack's PD transfer ports; this chart's PD receivers name their own",
        "ports/9999": "production-stack's PD transfer ports; this chart's PD receivers name their own",
        "env/HF_HOME/value": "without pvcStorage the model cache is an emptyDir at /data (production-stack: the "
        "container's /tmp)",
        "containers/main/securityContext": "servingEngineSpec.containerSecurityContext: this chart's default drops "
        "every capability (production-stack's: runAsNonRoot false); NOTES says so where NIXL may need IPC_LOCK",
        "spec/template/spec/hostname": "production-stack gives every replica one hostname; here each pod keeps its own "
        "name, which LMCache's instance ids and the router's engine names are",
        "spec/template/spec/subdomain": "with a ClusterIP Service a subdomain gives the pods no DNS name",
        "ports/zmq-port": "production-stack's Service exposes 55555 and 9999 for its PD transfer; this chart's PD "
        "receivers are reached on their pods' own ports",
        "ports/ucx-port": "production-stack's Service exposes 55555 and 9999 for its PD transfer; this chart's PD "
        "receivers are reached on their pods' own ports",
    },
}


def allowed(key: str) -> dict[str, str]:
    out = dict(EQUIVALENT["*"])
    for prefix, patterns in EQUIVALENT.items():
        if prefix != "*" and (key == prefix or key.startswith(prefix + ".")):
            out |= patterns
    return out


OVERRIDES |= {
    "servingEngineSpec.env": ENV,
    "servingEngineSpec.modelSpec.[].pvcExistingClaimName": "models-claim",
    "servingEngineSpec.modelSpec.[].pvcStorage.emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"},
    "servingEngineSpec.modelSpec.[].vllmConfig.prometheusMultiprocDir": "/tmp/prometheus",
    "servingEngineSpec.modelSpec.[].chatTemplate": "chat.jinja",
    "servingEngineSpec.modelSpec.[].chatTemplateConfigMap": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "servingEngineSpec.modelSpec.[].enableTool": True,
    "servingEngineSpec.modelSpec.[].toolCallParser": "llama3_json",
    "servingEngineSpec.modelSpec.[].envFromSecret.name": "s3",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.cudaVisibleDevices": "1",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.diskOffloadingBufferSize": 10,
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enableController": True,
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enableNixl": True,
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enablePD": True,
    "servingEngineSpec.modelSpec.[].lmcacheConfig.kvRole": "kv_producer",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.p2pHost": "localhost",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.p2pInitPorts": "30081",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.workerHeartbeatTime": 10,
    "servingEngineSpec.modelSpec.[].lmcacheConfig.workerPorts": "8001",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.controllerPort": 9000,
    "servingEngineSpec.modelSpec.[].lmcacheConfig.controllerReplyPort": 9001,
    "servingEngineSpec.modelSpec.[].pdb.minAvailable": 1,
    "servingEngineSpec.modelSpec.[].pdb.maxUnavailable": 1,
    "servingEngineSpec.modelSpec.[].vllmConfig.v1": 1,
    "routerSpec.lmcacheControllerReplyPort": 9001,
    "routerSpec.lmcacheControllerHeartbeatPort": 9002,
}
EXTRA |= {
    "servingEngineSpec.modelSpec.[].pvcExistingClaimName": [
        ("servingEngineSpec.modelSpec.[].pvcStorage", "10Gi")
    ],
    "servingEngineSpec.modelSpec.[].chatTemplateConfigMap": [
        ("servingEngineSpec.modelSpec.[].chatTemplate", "chat.jinja")
    ],
    "servingEngineSpec.modelSpec.[].pdb": [("servingEngineSpec.modelSpec.[].pdb.enabled", True)],
    "servingEngineSpec.modelSpec.[].lmcacheConfig": [
        ("servingEngineSpec.modelSpec.[].vllmConfig", {"enablePrefixCaching": True}),
        ("servingEngineSpec.modelSpec.[].lmcacheConfig.enabled", True),
    ],
    "servingEngineSpec.modelSpec.[].keda.triggers": [
        (
            "servingEngineSpec.modelSpec.[].keda.triggers",
            {
                "type": "prometheus",
                "metadata": {
                    "serverAddress": "http://prom:9090",
                    "query": "sum(vllm:num_requests_waiting)",
                    "threshold": "5",
                },
            },
        )
    ],
}
OVERRIDES |= {
    "servingEngineSpec.modelSpec.[].pdb.annotations": {"probe": "x"},
    "servingEngineSpec.modelSpec.[].pdb.labels": {"probe": "x"},
}
EQUIVALENT["servingEngineSpec.modelSpec.[].chatTemplateConfigMap"] = {
    "data/chat.jinja": "the same template text, without the newline production-stack's chart puts before it",
}
OVERRIDES["servingEngineSpec.modelSpec.[].lmcacheConfig.enabled"] = True
