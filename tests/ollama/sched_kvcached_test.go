package server

// Ollama's own scheduler (server/sched.go of each supported Ollama version,
// patched by integrations/ollama/patches), driven the way Ollama's sched_test.go drives
// it: fake GPU discovery, mock runners, real scheduling loop. The GPU has
// the same memory in every case; what differs is whether the KV cache is in
// kvcached-serve pages (a real daemon, started here). scripts/test-ollama.sh
// copies this file into the patched work tree's server/ and runs
// `go test ./server -run Kvcached` with KVCACHED_SERVE set.
//
//   - stock: a second model makes Ollama evict the first, because its
//     pre-load estimate (PredictServerVRAM) counts the full worst-case KV.
//   - kvcached: the estimate counts the runner's guarantee; both models stay.
//   - kvcached, daemon budget held by an idle runner: the scheduler asks it to
//     shrink (RequestShrink, same uid) and loads the second model without
//     unloading anything.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	kvcached "github.com/kvcached/kvcached-service/clients/go"
	"github.com/kvcached/kvcached-service/clients/go/ollama"
	"github.com/stretchr/testify/require"

	"github.com/ollama/ollama/api"
	"github.com/ollama/ollama/envconfig"
	"github.com/ollama/ollama/format"
	"github.com/ollama/ollama/llm"
	"github.com/ollama/ollama/ml"
)

const (
	kvcTestCtx    = 32768 // num_ctx of both models
	kvcTestLayers = 8
	kvcTestEmbd   = 1024
	// F16 KV at num_ctx: 2 x 8 layers x 1024 x 32768 x 2 B = 1 GiB
	kvcWorstCase = 2 * kvcTestLayers * kvcTestEmbd * kvcTestCtx * 2
)

var kvcGPU = ml.DeviceID{ID: "GPU-kvcached-test", Library: "CUDA"}

// kvcRunner is a mock runner whose pid is this process (the daemon names a
// session's process by SO_PEERCRED, and the test holds the runner's pages
// in this process).
type kvcRunner struct {
	*mockLlm
	pid int
}

func (r *kvcRunner) Pid() int { return r.pid }

// kvcScenario: an 8-layer, 1024-wide llama (KV dominates) at num_ctx 32768.
func kvcScenario(t *testing.T, ctx context.Context, name string, vram uint64) (*reqBundle, *kvcRunner) {
	t.Helper()
	b := &reqBundle{}
	b.ctx, b.ctxDone = context.WithCancel(ctx)
	// no tensors: nil fits createBinFile's tensor slice in every version
	// (v0.34.0: []*ggml.Tensor, v0.34.4: []*gguftest.Tensor), and the
	// scheduler reads only the metadata and the file size
	_, digest := createBinFile(t, map[string]any{
		"general.architecture":          "llama",
		"general.name":                  name, // distinct blobs, distinct digests
		"llama.context_length":          uint32(131072),
		"llama.embedding_length":        uint32(kvcTestEmbd),
		"llama.block_count":             uint32(kvcTestLayers),
		"llama.attention.head_count":    uint32(8),
		"llama.attention.head_count_kv": uint32(8),
		"tokenizer.ggml.tokens":         []string{" "},
		"tokenizer.ggml.scores":         []float32{0},
		"tokenizer.ggml.token_type":     []int32{0},
	}, nil)
	// the blob, as Ollama's ModelPath names it (the runner's session is named by its digest)
	p := filepath.Join(envconfig.Models(), "blobs", "sha256-"+strings.TrimPrefix(digest, "sha256:"))
	opts := api.DefaultOptions()
	opts.NumCtx = kvcTestCtx
	b.req = &LlmRequest{ctx: b.ctx, model: &Model{Name: name, ModelPath: p}, opts: opts,
		sessionDuration: &api.Duration{Duration: time.Minute}, successCh: make(chan *runnerRef, 1), errCh: make(chan error, 1)}
	r := &kvcRunner{mockLlm: &mockLlm{vramSize: vram, vramByGPU: map[ml.DeviceID]uint64{kvcGPU: vram}}, pid: os.Getpid()}
	b.srv = r.mockLlm
	return b, r
}

// kvcScheduler: one CUDA GPU with free memory gib (the driver's view; the
// scheduler subtracts its runners' VRAMByGPU itself).
func kvcScheduler(ctx context.Context, free uint64) *Scheduler {
	s := InitScheduler(ctx)
	s.waitForRecovery = 10 * time.Millisecond
	s.getGpuFn = func(ctx context.Context, runners []ml.FilteredRunnerDiscovery) []ml.DeviceInfo {
		g := ml.DeviceInfo{DeviceID: kvcGPU, Name: "CUDA0"}
		g.TotalMemory, g.FreeMemory = free, free
		return []ml.DeviceInfo{g}
	}
	s.getSystemInfoFn = getSystemInfoFn
	return s
}

func kvcLoad(t *testing.T, ctx context.Context, s *Scheduler, b *reqBundle, r *kvcRunner) *runnerRef {
	t.Helper()
	s.newServerFn = func(ml.SystemInfo, []ml.DeviceInfo, string, *llm.KvcachedModel, []string, []string, api.Options, int, llm.LlamaServerConfig) (llm.LlamaServer, error) {
		r.modelPath = b.req.model.ModelPath
		return r, nil
	}
	s.pendingReqCh <- b.req
	select {
	case ref := <-b.req.successCh:
		return ref
	case err := <-b.req.errCh:
		t.Fatal(err)
	case <-ctx.Done():
		t.Fatal("timeout loading " + b.req.model.Name)
	}
	return nil
}

func kvcLoaded(s *Scheduler) int {
	s.loadedMu.Lock()
	defer s.loadedMu.Unlock()
	return len(s.loaded)
}

// kvcDaemon starts kvcached-serve (KVCACHED_SERVE) with a budget; the handle
// replaces llm.Kvcached for the test.
func kvcDaemon(t *testing.T, budget string) *ollama.Handle {
	t.Helper()
	serve := os.Getenv("KVCACHED_SERVE")
	if serve == "" {
		t.Fatal("KVCACHED_SERVE is not set (scripts/test-ollama.sh sets it to .venv/bin/kvcached-serve)")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "k.sock")
	var log bytes.Buffer
	cmd := exec.Command(serve, "--socket", sock, "--backend", "host", "--memory-limit", budget, "--page-size", "2MiB",
		"--reclaim-timeout-ms", "3000")
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	o := ollama.New(sock, nil)
	o.RetryInterval = 50 * time.Millisecond
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := o.Stats(t.Context(), true); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("daemon not up: %v\n%s", err, log.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Cleanup(o.Close)
	saved := llm.Kvcached
	llm.Kvcached = func() *ollama.Handle { return o }
	t.Cleanup(func() { llm.Kvcached = saved })
	return o
}

// The GPU has 1.5 GiB; each model's worst-case KV is 1 GiB.
const kvcTestGPU = 1536 * format.MebiByte

// kvcIdle: the model is loaded and no request holds it.
func kvcIdle(s *Scheduler, m *Model) bool {
	s.loadedMu.Lock()
	ref := s.loaded[schedulerModelKey(m)]
	s.loadedMu.Unlock()
	if ref == nil {
		return false
	}
	ref.refMu.Lock()
	defer ref.refMu.Unlock()
	return ref.refCount == 0
}

func TestKvcachedStockSchedulerEvicts(t *testing.T) {
	ctx, done := context.WithTimeout(t.Context(), 10*time.Second)
	defer done()
	saved := llm.Kvcached
	llm.Kvcached = func() *ollama.Handle { return nil } // no daemon: Ollama as published
	t.Cleanup(func() { llm.Kvcached = saved })
	s := kvcScheduler(ctx, kvcTestGPU)
	// Without the daemon a loaded runner holds its whole KV cache.
	a, ra := kvcScenario(t, ctx, "model-a", kvcWorstCase)
	b, rb := kvcScenario(t, ctx, "model-b", kvcWorstCase)
	s.Run(ctx)
	kvcLoad(t, ctx, s, a, ra)
	a.ctxDone() // A goes idle
	require.Eventually(t, func() bool { return kvcIdle(s, a.req.model) }, 5*time.Second, 5*time.Millisecond)
	kvcLoad(t, ctx, s, b, rb)
	require.True(t, ra.closeCalled, "stock Ollama should have unloaded model A to fit model B")
	require.Equal(t, 1, kvcLoaded(s))
	t.Logf("stock: GPU %s, predicted B = %s (file + worst-case KV): A evicted",
		format.HumanBytes2(kvcTestGPU), format.HumanBytes2(llm.PredictServerVRAM(b.req.model.ModelPath, mustModel(t, b), kvcTestCtx)))
}

func TestKvcachedSchedulerKeepsBoth(t *testing.T) {
	ctx, done := context.WithTimeout(t.Context(), 20*time.Second)
	defer done()
	o := kvcDaemon(t, "1GiB")
	s := kvcScheduler(ctx, kvcTestGPU)
	// With the daemon an idle runner holds about its guarantee.
	guarantee := llm.KvcachedGuarantee("", kvcGeometry(t), kvcTestCtx, 1, "")
	require.Equal(t, uint64(2*kvcTestLayers*2*format.MebiByte), guarantee) // 16 tensors x one 2 MiB page
	a, ra := kvcScenario(t, ctx, "model-a", guarantee)
	b, rb := kvcScenario(t, ctx, "model-b", guarantee)
	s.Run(ctx)
	kvcLoad(t, ctx, s, a, ra)
	a.ctxDone()
	require.Eventually(t, func() bool { return kvcIdle(s, a.req.model) }, 5*time.Second, 5*time.Millisecond)
	kvcLoad(t, ctx, s, b, rb)
	require.False(t, ra.closeCalled, "model A must stay loaded")
	require.Equal(t, 2, kvcLoaded(s))
	pred := llm.PredictServerVRAM(b.req.model.ModelPath, mustModel(t, b), kvcTestCtx)
	require.Less(t, pred, uint64(64*format.MebiByte))
	st, err := o.Stats(ctx, true)
	require.NoError(t, err)
	t.Logf("kvcached: GPU %s, predicted B = %s (file + guarantee): both loaded; daemon budget %s",
		format.HumanBytes2(kvcTestGPU), format.HumanBytes2(pred), format.HumanBytes2(st.Total.BudgetBytes))
}

func TestKvcachedSchedulerShrinksIdleRunnerBeforeUnloading(t *testing.T) {
	ctx, done := context.WithTimeout(t.Context(), 30*time.Second)
	defer done()
	o := kvcDaemon(t, "256MiB")
	s := kvcScheduler(ctx, kvcTestGPU)
	guarantee := llm.KvcachedGuarantee("", kvcGeometry(t), kvcTestCtx, 1, "")
	a, ra := kvcScenario(t, ctx, "model-a", guarantee)
	b, rb := kvcScenario(t, ctx, "model-b", guarantee)

	// Model A's runner: a session named by A's digest, holding 250 of the
	// 256 MiB, that answers reclaim requests by trimming (as the hook does).
	c, err := kvcached.Dial(ctx, o.Socket())
	require.NoError(t, err)
	defer c.Close()
	digestA := ollama.DigestFromBlobPath(a.req.model.ModelPath)
	var region atomic.Pointer[kvcached.Region]
	var reclaims atomic.Int32
	sess, err := c.OpenSession(ctx, digestA, kvcached.WithGuaranteedBytes(guarantee),
		kvcached.WithLabels(map[string]string{ollama.LabelModelDigest: digestA}),
		kvcached.WithReclaimHandler(func(ctx context.Context, r kvcached.Reclaim) {
			reclaims.Add(1)
			reg := region.Load()
			keep := uint64(0)
			if want := r.Pages * reg.PageSize(); reg.MappedBytes() > want {
				keep = reg.MappedBytes() - want
			}
			_ = reg.Trim(ctx, keep)
		}))
	require.NoError(t, err)
	defer sess.Close(context.Background())
	reg, err := sess.NewRegion(ctx, 250*format.MebiByte)
	require.NoError(t, err)
	require.NoError(t, reg.Grow(ctx, reg.Size()))
	region.Store(reg)
	ra.vramByGPU[kvcGPU] = 250 * format.MebiByte // what the patched VRAMByGPU would read from the daemon

	s.Run(ctx)
	kvcLoad(t, ctx, s, a, ra)
	a.ctxDone()
	require.Eventually(t, func() bool { return kvcIdle(s, a.req.model) }, 5*time.Second, 5*time.Millisecond)
	fit, err := o.Fits(ctx, guarantee, "")
	require.NoError(t, err)
	require.False(t, fit.Fits, "B's guarantee must not fit before A shrinks: %+v", fit)

	kvcLoad(t, ctx, s, b, rb)
	require.False(t, ra.closeCalled, "model A must not be unloaded: it was asked to shrink instead")
	require.Equal(t, 2, kvcLoaded(s))
	require.Positive(t, reclaims.Load())
	require.Equal(t, guarantee, reg.MappedBytes(), "A shrank to its guarantee")
	t.Logf("kvcached: idle runner A shrank from 250 MiB to its guarantee %s after %d reclaim request(s); B loaded, nothing unloaded",
		format.HumanBytes2(guarantee), reclaims.Load())
}

// The KV geometry the runner's guarantee and maximum are computed from, read
// through this version's model metadata type (v0.34.0: *ggml.GGML, v0.34.4:
// *gguf.Model; llm/kvcached_model.go of patches/<version>/): per-layer KV
// head arrays (a layer of 0 heads has no cache), explicit K/V head sizes,
// and head sizes derived from the embedding over the smallest head count.
// Without a daemon (page 0) the guarantee is the exact bytes of 256 cells.
func TestKvcachedGeometryFromModelMetadata(t *testing.T) {
	saved := llm.Kvcached
	llm.Kvcached = func() *ollama.Handle { return nil }
	t.Cleanup(func() { llm.Kvcached = saved })
	for _, tc := range []struct {
		name    string
		kv      map[string]any
		rowSums uint64 // sum over layers of KV heads x (K + V head size)
	}{
		{"per-layer kv heads, explicit head sizes", map[string]any{
			"llama.block_count":             uint32(4),
			"llama.embedding_length":        uint32(1024),
			"llama.attention.head_count":    uint32(8),
			"llama.attention.head_count_kv": []uint32{8, 4, 0, 2},
			"llama.attention.key_length":    uint32(192),
			"llama.attention.value_length":  uint32(128),
		}, (8 + 4 + 0 + 2) * (192 + 128)},
		{"head size from the embedding over the smallest head count", map[string]any{
			"llama.block_count":             uint32(3),
			"llama.embedding_length":        uint32(1024),
			"llama.attention.head_count":    []int32{16, 8, 8},
			"llama.attention.head_count_kv": uint32(2),
		}, 3 * 2 * (1024/8 + 1024/8)},
		{"short kv head array: later layers take 1", map[string]any{
			"llama.block_count":             uint32(3),
			"llama.embedding_length":        uint32(512),
			"llama.attention.head_count":    uint32(4),
			"llama.attention.head_count_kv": []uint32{4, 2},
		}, (4 + 2 + 1) * (128 + 128)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kv := map[string]any{"general.architecture": "llama", "general.name": tc.name,
				"tokenizer.ggml.tokens": []string{" "}, "tokenizer.ggml.scores": []float32{0}, "tokenizer.ggml.token_type": []int32{0}}
			for k, v := range tc.kv {
				kv[k] = v
			}
			p, _ := createBinFile(t, kv, nil)
			f, err := llm.LoadModel(p, 1024)
			require.NoError(t, err)
			for _, typ := range []struct {
				name string
				row  func(uint64) uint64
			}{{"", func(n uint64) uint64 { return 2 * n }}, {"q8_0", func(n uint64) uint64 { return n / 32 * 34 }}} {
				// num_ctx 100 pads to 256 cells; 4 slots do not change the guarantee
				require.Equal(t, 256*typ.row(tc.rowSums), llm.KvcachedGuarantee("", f, 100, 4, typ.name), "cache type %q", typ.name)
			}
		})
	}
}

// kvcGeometry: the test models' metadata (for the guarantee).
func kvcGeometry(t *testing.T) *llm.KvcachedModel {
	t.Helper()
	b, _ := kvcScenario(t, t.Context(), "geometry", 0)
	return mustModel(t, b)
}

func mustModel(t *testing.T, b *reqBundle) *llm.KvcachedModel {
	t.Helper()
	f, err := llm.LoadModel(b.req.model.ModelPath, 1024)
	if err != nil {
		t.Fatal(fmt.Errorf("load %s: %w", b.req.model.ModelPath, err))
	}
	return f
}
