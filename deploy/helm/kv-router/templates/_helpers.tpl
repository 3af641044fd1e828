{{/* Names and labels shared by every object of the chart. */}}

{{- define "kv-router.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kv-router.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Labels of every object; `component` names the part (router, gateway, engine). */}}
{{- define "kv-router.labels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The selector of one component's pods. */}}
{{- define "kv-router.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
Environment every component shares: the ConfigMap of connection settings, the NATS
credential files of nats.existingSecret, the etcd user of etcd.existingSecret, and
extraEnv.
*/}}
{{- define "kv-router.sharedEnv" -}}
envFrom:
  - configMapRef:
      name: {{ include "kv-router.fullname" . }}-env
{{- if or .Values.nats.credsKey .Values.nats.tlsCaKey .Values.etcd.existingSecret .Values.extraEnv }}
env:
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
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The mount of nats.existingSecret, for a container's volumeMounts. */}}
{{- define "kv-router.natsMount" -}}
{{- if .Values.nats.existingSecret }}
- name: nats-credentials
  mountPath: /etc/kv-router/nats
  readOnly: true
{{- end }}
{{- end -}}

{{/* The volume of nats.existingSecret, for a pod's volumes. */}}
{{- define "kv-router.natsVolume" -}}
{{- with .Values.nats.existingSecret }}
- name: nats-credentials
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}
