"""Where the engines come from: a static list or Kubernetes pods (an InferencePool's among them)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting

DISCOVERY_KINDS = ("static", "k8s", "external-only")
ENGINE_ROLES = ("both", "prefill", "decode")  # an engine's role (vllm_stack.engines.engine.ROLES)
K8S_WATCH = "Kubernetes discovery's watch is built at start"
K8S_ROLES = "Kubernetes discovery reads engine roles with the labels given at start"
LABELS_DOC = "production-stack's: comma-separated values of the pods' 'model' label that mark {} engines"


@dataclass(frozen=True)
class DiscoveryGroup:
    """Engine discovery. production-stack's ``*_model_labels``: engine pods whose ``model`` label is one
    of these are prefill / decode engines (the chart's pods carry vllm-stack.io/role, which wins)."""

    __slots__ = ()

    service_discovery: str = setting(
        "static",
        doc="where the engines come from: static (--static-backends), k8s (pods) or external-only (none: "
        "only --external-providers-config's providers)",
        choices=DISCOVERY_KINDS,
        restart="the discovery source is built at start",
        chart="routerSpec.serviceDiscovery",
    )
    static_backends: tuple[str, ...] = setting(
        (), doc="comma-separated engine URLs", chart="routerSpec.staticBackends"
    )
    static_models: tuple[str, ...] = setting(
        (),
        doc="comma-separated model names, one per static backend (optional)",
        chart="routerSpec.staticModels",
    )
    static_roles: tuple[str, ...] = setting(
        (), doc="comma-separated roles (prefill, decode, both), one per static backend (optional)"
    )
    prefill_model_labels: tuple[str, ...] = setting((), doc=LABELS_DOC.format("prefill"), restart=K8S_ROLES)
    decode_model_labels: tuple[str, ...] = setting((), doc=LABELS_DOC.format("decode"), restart=K8S_ROLES)
    k8s_namespace: str = setting(
        "default", doc="k8s discovery: the engine pods' namespace", restart=K8S_WATCH
    )
    k8s_label_selector: str = setting(
        "", doc="k8s discovery: the engine pods' label selector", restart=K8S_WATCH
    )
    k8s_port: int = setting(
        8000,
        doc="k8s discovery: the engines' port",
        restart=K8S_WATCH,
        chart="servingEngineSpec.containerPort",
    )
    # External OpenAI-compatible providers (docs/external-providers.md), production-stack's file format
    external_providers_config: str | None = setting(
        None,
        doc="YAML file of external OpenAI-compatible providers (production-stack's external_providers list)",
        restart="the providers' engines, keys and TLS contexts are built at start",
    )
    external_ca_file: str | None = setting(
        None,
        doc="CA bundle for the external providers' https (default: the system's; a provider's ca_file wins)",
        restart="the providers' TLS contexts are built at start",
    )
    # The Inference Extension (docs/inference-extension.md): its engines the pods of this InferencePool
    inference_pool: str = setting(
        "",
        doc="engines: the pods of this InferencePool (its selector and target port; with k8s discovery)",
        restart="the InferencePool's selector and port are read at start",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on discovery settings that cannot work."""
        if self.service_discovery not in DISCOVERY_KINDS:
            raise ConfigError(f"service_discovery must be one of {DISCOVERY_KINDS}")
        if (
            self.service_discovery == "static"
            and not self.static_backends
            and not self.external_providers_config
        ):
            raise ConfigError("static discovery needs static_backends")
        if self.service_discovery == "external-only" and not self.external_providers_config:
            raise ConfigError("external-only discovery needs external_providers_config")
        if self.static_models and len(self.static_models) != len(self.static_backends):
            raise ConfigError("static_models must have one entry per static backend")
        if self.static_roles and len(self.static_roles) != len(self.static_backends):
            raise ConfigError("static_roles must have one entry per static backend")
        for role in self.static_roles:
            if role not in ENGINE_ROLES:
                raise ConfigError(f"static_roles: {role!r} is not one of {ENGINE_ROLES}")
        if set(self.prefill_model_labels) & set(self.decode_model_labels):
            raise ConfigError("a model label cannot be both in prefill_model_labels and decode_model_labels")
        for backend in self.static_backends:
            if not backend.startswith(("http://", "https://")):
                raise ConfigError(f"static backend {backend!r} must be an http(s):// URL")
        if self.inference_pool and self.service_discovery != "k8s":
            raise ConfigError("inference_pool needs service_discovery k8s (its pods are the engines)")
