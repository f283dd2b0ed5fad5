{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name; components append -target, -draft, -gateway (so 55 characters leave room). */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object; call with (dict "root" $ "component" "target"). */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* repository:tag, or repository@digest once the image is in a registry (digest: sha256:...). */}}
{{- define "tandem.image" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository (toString .tag) }}
{{- end }}
{{- end }}

{{/* Name of the model PVC (created or existing). */}}
{{- define "tandem.modelsClaim" -}}
{{- with .Values.models.persistentVolumeClaim.existingClaim }}{{ . }}{{ else }}{{ include "tandem.fullname" . }}-models{{ end }}
{{- end }}

{{/*
"true" when a component loads its model from a Hub reference (hf://...): the target always, the draft with
drafter: model and enabled (the n-gram drafter loads nothing). Call with (dict "root" $ "component" "target").
*/}}
{{- define "tandem.fromHub" -}}
{{- $v := index .root.Values .component -}}
{{- $loads := or (eq .component "target") (and $v.enabled (has $v.drafter (list "model" "ngram,model"))) -}}
{{- if and $loads (hasPrefix "hf://" (toString $v.model)) -}}
{{- if eq .root.Values.models.storage "none" }}
{{- fail (printf "%s.model is a Hub reference (%s): set models.storage to pvc or hostPath, the volume it is fetched into" .component $v.model) }}
{{- end -}}
true
{{- end -}}
{{- end }}

{{/* HF_HOME: the Hub cache on the models volume. */}}
{{- define "tandem.hubHome" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.models.mountPath) .Values.models.hub.home }}
{{- end }}

{{/*
The init container of a pod that loads a model by Hub reference: tandem-fetch (in the model image) downloads it into
the models volume, mounted read-write here only, and checks its size and SHA-256; a restart downloads nothing.
Call with (dict "root" $ "component" "target").
*/}}
{{- define "tandem.fetchModel" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .component -}}
{{- $hub := $root.Values.models.hub -}}
- name: fetch-model
  image: {{ include "tandem.image" $v.image | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - /opt/venv/bin/tandem-fetch
  args:
    - {{ $v.model | quote }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  env:
    - name: HF_HOME
      value: {{ include "tandem.hubHome" $root | quote }}
    {{- with $hub.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $hub.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $hub.tokenSecret.key }}
    {{- end }}
    - name: XDG_CACHE_HOME
      value: /tmp/.cache
  resources:
    {{- toYaml $hub.resources | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: models
      mountPath: {{ $root.Values.models.mountPath }}
{{- end }}

{{/* The gRPC address a component is reached at, inside the cluster. */}}
{{- define "tandem.address" -}}
{{- $svc := index .root.Values .component -}}
{{- printf "%s-%s:%v" (include "tandem.fullname" .root) .component $svc.port }}
{{- end }}

{{/*
One model service (target or draft): Deployment and Service.
Call with (dict "root" $ "component" "target" "grpcService" "tandem.v1.Target" "envPrefix" "TANDEM_TARGET_").
*/}}
{{- define "tandem.modelService" -}}
{{- $root := .root -}}
{{- $component := .component -}}
{{- $v := index $root.Values $component -}}
{{- $fullname := printf "%s-%s" (include "tandem.fullname" $root) $component -}}
{{- $p := .envPrefix -}}
{{- $ctx := dict "root" $root "component" $component -}}
{{- $fromHub := include "tandem.fromHub" $ctx -}}
{{- if not (has $v.gpu.vendor (list "none" "nvidia" "amd")) }}
{{- fail (printf "%s.gpu.vendor must be none, nvidia or amd, not %q" $component $v.gpu.vendor) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" $ctx | nindent 4 }}
spec:
  # One replica: sessions (and their KV cache) live in this process; a second replica would split them.
  replicas: 1
  # A GPU is held until the old pod is gone: never run two at once.
  strategy:
    type: Recreate
  revisionHistoryLimit: 3
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.labels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
        {{- with $v.supplementalGroups }}
        supplementalGroups:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      terminationGracePeriodSeconds: 30
      {{- if $fromHub }}
      initContainers:
        {{- include "tandem.fetchModel" $ctx | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "tandem.image" $v.image | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          env:
            - name: TANDEM_SERVICE
              value: {{ $component | quote }}
            # 0.0.0.0 in the pod: the gateway (through the Service) and the kubelet's probes reach the pod's IP.
            - name: {{ $p }}HOST
              value: "0.0.0.0"
            - name: {{ $p }}PORT
              value: {{ $v.port | quote }}
            # Verify/Propose over plain frames (tandem/frames.py): a fixed port, so the Service can carry it.
            - name: {{ $p }}FRAME_PORT
              value: {{ $v.framePort | quote }}
            {{- include "tandem.modelEnv" (dict "root" $root "component" $component "envPrefix" $p) | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            {{- if ge (int $v.framePort) 1 }}
            - name: frames
              containerPort: {{ $v.framePort }}
              protocol: TCP
            {{- end }}
          # Native gRPC probes on grpc.health.v1: NOT_SERVING while the model loads, SERVING once it can answer.
          startupProbe:
            grpc:
              port: {{ $v.port }}
              service: {{ .grpcService }}
            periodSeconds: {{ $v.startupProbe.periodSeconds }}
            failureThreshold: {{ $v.startupProbe.failureThreshold }}
            timeoutSeconds: {{ $v.startupProbe.timeoutSeconds }}
          readinessProbe:
            grpc:
              port: {{ $v.port }}
              service: {{ .grpcService }}
            periodSeconds: {{ $v.readinessProbe.periodSeconds }}
            failureThreshold: {{ $v.readinessProbe.failureThreshold }}
            timeoutSeconds: {{ $v.readinessProbe.timeoutSeconds }}
          livenessProbe:
            grpc:
              port: {{ $v.port }}
            periodSeconds: {{ $v.livenessProbe.periodSeconds }}
            failureThreshold: {{ $v.livenessProbe.failureThreshold }}
            timeoutSeconds: {{ $v.livenessProbe.timeoutSeconds }}
          resources:
            {{- $resources := deepCopy (default (dict) $v.resources) }}
            {{- if ne $v.gpu.vendor "none" }}
            {{- $gpu := dict (printf "%s.com/gpu" $v.gpu.vendor) (toString $v.gpu.count) }}
            {{- $_ := set $resources "limits" (merge (default (dict) $resources.limits) $gpu) }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if ne $root.Values.models.storage "none" }}
            - name: models
              mountPath: {{ $root.Values.models.mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: 1Gi
        {{- if eq $root.Values.models.storage "hostPath" }}
        - name: models
          hostPath:
            path: {{ $root.Values.models.hostPath.path }}
            type: {{ $root.Values.models.hostPath.type }}
        {{- else if eq $root.Values.models.storage "pvc" }}
        - name: models
          persistentVolumeClaim:
            claimName: {{ include "tandem.modelsClaim" $root }}
            {{- if not $fromHub }}
            readOnly: true
            {{- end }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $fullname }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" $ctx | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "tandem.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: kubernetes.io/h2c
    {{- if ge (int $v.framePort) 1 }}
    - name: frames
      port: {{ $v.framePort }}
      targetPort: frames
      protocol: TCP
    {{- end }}
{{- end }}

{{/*
A model's settings as environment variables (not its address: a service binds its own, an in-process target none).
Call with (dict "root" $ "component" "target" "envPrefix" "TANDEM_TARGET_").
*/}}
{{- define "tandem.modelEnv" -}}
{{- $root := .root -}}
{{- $component := .component -}}
{{- $v := index $root.Values $component -}}
{{- $p := .envPrefix -}}
{{- if $v.model }}
- name: {{ $p }}MODEL
  value: {{ $v.model | quote }}
{{- end }}
{{- if include "tandem.fromHub" (dict "root" $root "component" $component) }}
# Fetched and checked by the init container: read offline from the Hub cache on the models volume.
- name: HF_HOME
  value: {{ include "tandem.hubHome" $root | quote }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- if eq $component "draft" }}
- name: {{ $p }}DRAFTER
  value: {{ $v.drafter | quote }}
{{- end }}
{{- if eq $component "target" }}
- name: {{ $p }}VERIFY_MODE
  value: {{ $v.verifyMode | quote }}
{{- end }}
- name: {{ $p }}N_GPU_LAYERS
  value: {{ $v.nGpuLayers | quote }}
- name: {{ $p }}MAIN_GPU
  value: {{ $v.mainGpu | quote }}
- name: {{ $p }}SPLIT_MODE
  value: {{ $v.splitMode | quote }}
- name: {{ $p }}N_THREADS
  value: {{ $v.nThreads | quote }}
- name: {{ $p }}N_CTX
  value: {{ $v.nCtx | quote }}
- name: {{ $p }}MAX_SESSIONS
  value: {{ $v.maxSessions | quote }}
- name: {{ $p }}CACHE_TYPE_K
  value: {{ $v.cacheTypeK | quote }}
- name: {{ $p }}CACHE_TYPE_V
  value: {{ $v.cacheTypeV | quote }}
- name: {{ $p }}FLASH_ATTN
  value: {{ $v.flashAttn | quote }}
- name: {{ $p }}LOG_LEVEL
  value: {{ $v.logLevel | quote }}
# The root filesystem is read-only: caches go to the /tmp emptyDir.
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: CUDA_CACHE_PATH
  value: /tmp/.nv
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
