{{/*
The `kv-router relay` sidecar of an engine pod (docs/engines.md, step 2): reads the
engine's ZMQ KV events on the pod's loopback, publishes them and the engine's load to
NATS, and registers the worker (with the pod's engine URL for the gateway) in etcd.
It shares the router's ConfigMap and NATS secret.

The relay reads the engine's block size and KV capacity from the engine's metrics
page (vllm:cache_config_info, SGLang's page_size and pool size), so no number the
engine knows is set here. The worker id is claimed in etcd by the relay itself,
derived from the pod name (KV_RELAY_WORKER_NAME): unique in the namespace, stable
across restarts of the same pod.
*/}}
{{- define "kv-router.relayContainer" -}}
{{- $e := .Values.engines -}}
- name: kv-router-relay
  image: {{ include "kv-router.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - relay
    {{- range $e.relay.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  envFrom:
    - configMapRef:
        name: {{ include "kv-router.fullname" . }}-env
  env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    # The worker id is derived from this name and claimed in etcd (see above).
    - name: KV_RELAY_WORKER_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: KV_RELAY_ENGINE_ENDPOINT
      value: tcp://127.0.0.1:{{ $e.eventsPort }}
    - name: KV_RELAY_REPLAY_ENDPOINT
      value: tcp://127.0.0.1:{{ $e.replayPort }}
    - name: KV_RELAY_DP_SIZE
      value: {{ $e.relay.dpSize | quote }}
    - name: KV_RELAY_TOPIC
      value: {{ $e.topic | quote }}
    # Load, block size and KV capacity, read on the pod's loopback.
    - name: KV_RELAY_METRICS_URL
      value: http://127.0.0.1:{{ $e.port }}/metrics
    # How the gateway reaches this engine: the pod's address.
    - name: KV_RELAY_ENGINE_URL
      value: http://$(POD_IP):{{ $e.port }}
    - name: KV_RELAY_HTTP_LISTEN
      value: 0.0.0.0:{{ $e.relay.metricsPort }}
    {{- if .Values.nats.credsKey }}
    - name: KV_ROUTER_NATS_CREDS
      value: /etc/kv-router/nats/{{ .Values.nats.credsKey }}
    {{- end }}
    {{- if .Values.nats.tlsCaKey }}
    - name: KV_ROUTER_NATS_TLS_CA
      value: /etc/kv-router/nats/{{ .Values.nats.tlsCaKey }}
    {{- end }}
    {{- with .Values.etcd.existingSecret }}
    - name: KV_ROUTER_ETCD_USER
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: username
    - name: KV_ROUTER_ETCD_PASSWORD
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: password
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: relay-metrics
      containerPort: {{ $e.relay.metricsPort }}
  resources:
    {{- toYaml $e.relay.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.containerSecurityContext | nindent 4 }}
  {{- with (include "kv-router.natsMount" .) }}
  volumeMounts:
    {{- . | nindent 4 }}
  {{- end }}
{{- end -}}
