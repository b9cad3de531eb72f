package kvcached

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// What Ollama's scheduler needs: what a runner really holds, asking an idle
// runner to shrink before unloading a model, and the environment of a
// llama-server child. A runner's session is named by the model blob's
// sha256 digest and labelled model_digest=<digest> (ChildEnv arranges it).

// Environment a runner (llama-server child) reads; see ChildEnv.
const (
	EnvSessionName   = "KVCACHED_SESSION_NAME"   // the session name: the model's sha256 digest
	EnvSessionLabels = "KVCACHED_SESSION_LABELS" // k=v,k=v
	EnvGuaranteed    = "KVCACHED_GUARANTEED_BYTES"
	EnvMaxBytes      = "KVCACHED_MAX_BYTES"
	EnvPriority      = "KVCACHED_PRIORITY"
	// LabelModelDigest is the label RunnerUsage matches besides the name.
	LabelModelDigest = "model_digest"
)

// RunnerConfig describes one runner for ChildEnv.
type RunnerConfig struct {
	Socket          string // the daemon's socket (required)
	ModelDigest     string // "sha256:<hex>" of the model blob (required)
	Labels          map[string]string
	GuaranteedBytes uint64
	MaxBytes        uint64
	Priority        int32
}

// ChildEnv returns the variables to append to a llama-server child's
// environment (exec.Cmd.Env) so that it opens its session on the daemon
// under the model's digest. Ollama's children inherit the server's
// environment, so OLLAMA_KVCACHED_SOCKET alone already reaches them; the
// rest says whose pages they are.
func ChildEnv(cfg RunnerConfig) ([]string, error) {
	if cfg.Socket == "" {
		return nil, newError(ErrNoSocket, "ChildEnv", "no socket path")
	}
	if !strings.HasPrefix(cfg.ModelDigest, "sha256:") || len(cfg.ModelDigest) != len("sha256:")+64 {
		return nil, newError(ErrInvalidArgument, "ChildEnv", "model digest %q is not sha256:<64 hex digits>", cfg.ModelDigest)
	}
	labels := map[string]string{LabelModelDigest: cfg.ModelDigest}
	for k, v := range cfg.Labels {
		if strings.ContainsAny(k, ",=") || strings.ContainsAny(v, ",") {
			return nil, newError(ErrInvalidArgument, "ChildEnv", "label %q=%q contains ',' or '='", k, v)
		}
		labels[k] = v
	}
	keys := make([]string, 0, len(labels))
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+labels[k])
	}
	env := []string{
		EnvOllamaSocket + "=" + cfg.Socket,
		EnvSessionName + "=" + cfg.ModelDigest,
		EnvSessionLabels + "=" + strings.Join(parts, ","),
	}
	if cfg.GuaranteedBytes > 0 {
		env = append(env, EnvGuaranteed+"="+strconv.FormatUint(cfg.GuaranteedBytes, 10))
	}
	if cfg.MaxBytes > 0 {
		env = append(env, EnvMaxBytes+"="+strconv.FormatUint(cfg.MaxBytes, 10))
	}
	if cfg.Priority != 0 {
		env = append(env, EnvPriority+"="+strconv.FormatInt(int64(cfg.Priority), 10))
	}
	return env, nil
}

// SessionFromEnv reads what ChildEnv set (in a runner written in Go): the
// session name and the options to pass to OpenSession.
func SessionFromEnv() (string, []SessionOption, error) {
	name := os.Getenv(EnvSessionName)
	if name == "" {
		return "", nil, newError(ErrInvalidArgument, "SessionFromEnv", "%s is not set", EnvSessionName)
	}
	var opts []SessionOption
	if v := os.Getenv(EnvSessionLabels); v != "" {
		labels := map[string]string{}
		for _, kv := range strings.Split(v, ",") {
			k, val, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return "", nil, newError(ErrInvalidArgument, "SessionFromEnv", "%s: %q is not k=v", EnvSessionLabels, kv)
			}
			labels[k] = val
		}
		opts = append(opts, WithLabels(labels))
	}
	for _, e := range []struct {
		name string
		set  func(uint64) SessionOption
	}{{EnvGuaranteed, WithGuaranteedBytes}, {EnvMaxBytes, WithMaxBytes}} {
		if v := os.Getenv(e.name); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return "", nil, newError(ErrInvalidArgument, "SessionFromEnv", "%s=%q: %v", e.name, v, err)
			}
			opts = append(opts, e.set(n))
		}
	}
	if v := os.Getenv(EnvPriority); v != "" {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil {
			return "", nil, newError(ErrInvalidArgument, "SessionFromEnv", "%s=%q: %v", EnvPriority, v, err)
		}
		opts = append(opts, WithPriority(int32(n)))
	}
	return name, opts, nil
}

// RunnerUsage is what the daemon's books say one runner (model) holds.
type RunnerUsage struct {
	ModelDigest string
	Sessions    []SessionStats // every open session of the model
	HeldBytes   uint64         // summed over sessions and devices
	PagesHeld   uint64
	LastActive  time.Time
}

// RunnerUsage sums the sessions named digest or labelled
// model_digest=digest. It needs an admin session (others only see
// themselves). The daemon reports a session's bytes summed over devices
// (kvcached.v1.SessionStats has no per-device split); on a one-GPU host,
// or a runner bound to one GPU, that is the per-device number.
func (s *Session) RunnerUsage(ctx context.Context, digest string) (RunnerUsage, error) {
	st, err := s.Stats(ctx)
	if err != nil {
		return RunnerUsage{}, err
	}
	u := RunnerUsage{ModelDigest: digest}
	for _, ss := range st.Sessions {
		if ss.Name != digest && ss.Labels[LabelModelDigest] != digest {
			continue
		}
		u.Sessions = append(u.Sessions, ss)
		u.HeldBytes += ss.HeldBytes
		u.PagesHeld += ss.PagesHeld
		if ss.LastActive.After(u.LastActive) {
			u.LastActive = ss.LastActive
		}
	}
	return u, nil
}

// RequestShrink (admin) asks session id to shrink to targetBytes within
// timeout (0 = the daemon's default), through its Watch stream. It returns
// the pages asked for (0 if already small enough). The pages come back
// when the runner frees them; poll RunnerUsage to see it happen.
func (s *Session) RequestShrink(ctx context.Context, id, targetBytes uint64, timeout time.Duration) (uint64, error) {
	ref, gen, err := s.call("RequestShrink")
	if err != nil {
		return 0, err
	}
	r, err := s.c.rpc.RequestShrink(ctx, &pb.RequestShrinkRequest{Admin: ref, SessionId: id, TargetBytes: targetBytes,
		TimeoutMs: uint32(timeout / time.Millisecond)})
	if err != nil {
		return 0, s.rpcErr("RequestShrink", gen, err)
	}
	return r.GetPagesRequested(), nil
}

// ShrinkRunner (admin) asks every session of a model to shrink to
// targetBytes each and returns the pages asked for in total. Ollama's
// scheduler calls it for an idle runner before deciding to unload a model.
func (s *Session) ShrinkRunner(ctx context.Context, digest string, targetBytes uint64, timeout time.Duration) (uint64, error) {
	u, err := s.RunnerUsage(ctx, digest)
	if err != nil {
		return 0, err
	}
	var total uint64
	for _, ss := range u.Sessions {
		n, err := s.RequestShrink(ctx, ss.ID, targetBytes, timeout)
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}

// Limits are a session's reclaim limits; nil fields stay as they are.
type Limits struct {
	GuaranteedBytes *uint64
	MaxBytes        *uint64
	Priority        *int32
}

// SetLimits (admin) changes another session's limits.
func (s *Session) SetLimits(ctx context.Context, id uint64, l Limits) (SessionStats, error) {
	ref, gen, err := s.call("SetSessionLimits")
	if err != nil {
		return SessionStats{}, err
	}
	req := &pb.SetSessionLimitsRequest{Admin: ref, SessionId: id}
	if l.GuaranteedBytes != nil {
		req.GuaranteedBytes = *l.GuaranteedBytes
		req.SetFields = append(req.SetFields, "guaranteed_bytes")
	}
	if l.MaxBytes != nil {
		req.MaxBytes = *l.MaxBytes
		req.SetFields = append(req.SetFields, "max_bytes")
	}
	if l.Priority != nil {
		req.Priority = *l.Priority
		req.SetFields = append(req.SetFields, "priority")
	}
	r, err := s.c.rpc.SetSessionLimits(ctx, req)
	if err != nil {
		return SessionStats{}, s.rpcErr("SetSessionLimits", gen, err)
	}
	return sessionStatsFromPB(r.GetSession()), nil
}

var _ = fmt.Sprint
