"""The router's scheduling served as a Gateway API Inference Extension endpoint picker (EPP): an ext_proc
v3 gRPC server (:mod:`.server`) whose streams (:mod:`.stream`) run the director's stages
(:mod:`.request`) and name the engine to the gateway, with the engines and objectives of an
InferencePool read from the API server (:mod:`.inference_objects`)."""
