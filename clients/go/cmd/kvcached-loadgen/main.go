// Command kvcached-loadgen is an Ollama-shaped load generator for
// kvcached-serve: N runners (one session each, named like a model digest),
// each with per-layer K and V regions; requests grow the context from cell
// 0 in steps of 256 cells (llama.cpp's n_kv padding), finish and trim;
// idle runners answer reclaim requests by trimming. Every mapped page
// carries a stamp that is checked before it is unmapped. It reports ops/s
// (operations that allocated or freed pages; growth steps that stay within
// mapped pages cost nothing and are not counted) and latency percentiles,
// as text or JSON (-json) for the benchmark
// harness, and exits 1 if any check failed.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand"
	"os"
	"os/signal"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	kvcached "github.com/kvcached/kvcached-service/clients/go"
)

type config struct {
	socket    string
	runners   int
	layers    int
	cells     int
	cellBytes int
	step      int
	duration  time.Duration
	idle      float64
	wait      time.Duration
	seed      int64
	jsonOut   bool
	verbose   bool
}

type result struct {
	Runners      int                `json:"runners"`
	Layers       int                `json:"layers"`
	Regions      int                `json:"regions"`
	PageSize     uint64             `json:"page_size"`
	Backend      string             `json:"backend"`
	Transport    string             `json:"transport"` // "fd-channel" or "grpc": how Allocate/Free went
	DurationS    float64            `json:"duration_s"`
	Ops          int64              `json:"ops"`
	OpsPerSec    float64            `json:"ops_per_sec"`
	PagesMapped  int64              `json:"pages_mapped"`
	PagesFreed   int64              `json:"pages_freed"`
	Requests     int64              `json:"requests"`
	Exhausted    int64              `json:"resource_exhausted"`
	Reclaims     int64              `json:"reclaims_answered"`
	CheckedPages int64              `json:"pages_checked"`
	BadPages     int64              `json:"pages_bad"`
	Errors       int64              `json:"errors"`
	Latency      map[string]latency `json:"latency_us"`
}

type latency struct {
	Count int64   `json:"count"`
	P50   float64 `json:"p50"`
	P90   float64 `json:"p90"`
	P99   float64 `json:"p99"`
	Max   float64 `json:"max"`
}

type recorder struct {
	mu  sync.Mutex
	lat map[string][]time.Duration
}

func (r *recorder) add(op string, d time.Duration) {
	r.mu.Lock()
	r.lat[op] = append(r.lat[op], d)
	r.mu.Unlock()
}

func (r *recorder) summary() (map[string]latency, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]latency{}
	var ops int64
	for op, ds := range r.lat {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		q := func(p float64) float64 {
			return float64(ds[int(p*float64(len(ds)-1))].Nanoseconds()) / 1e3
		}
		out[op] = latency{Count: int64(len(ds)), P50: q(0.50), P90: q(0.90), P99: q(0.99), Max: q(1)}
		if op != "check" {
			ops += int64(len(ds))
		}
	}
	return out, ops
}

type stats struct {
	pagesMapped, pagesFreed, requests, exhausted, reclaims, checked, bad, errs atomic.Int64
}

type runner struct {
	id      int
	cfg     *config
	sess    *kvcached.Session
	regions []*kvcached.Region
	mu      sync.Mutex // one request or one reclaim at a time
	cells   int        // cells currently mapped (prefix of every region)
	gen     uint32
	stamps  [][]uint32 // per region, per page: the generation stamped, 0 = none
	rec     *recorder
	st      *stats
	log     *slog.Logger
}

func (r *runner) stamp(region, page int, gen uint32) []byte {
	b := make([]byte, 16)
	binary.LittleEndian.PutUint32(b[0:], uint32(r.id))
	binary.LittleEndian.PutUint32(b[4:], uint32(region))
	binary.LittleEndian.PutUint32(b[8:], uint32(page))
	binary.LittleEndian.PutUint32(b[12:], gen)
	return b
}

// grow maps every region's prefix up to cells and stamps the new pages.
func (r *runner) grow(ctx context.Context, cells int) error {
	bytes := uint64(cells * r.cfg.cellBytes)
	for i, reg := range r.regions {
		before := reg.MappedBytes()
		t0 := time.Now()
		err := reg.Grow(ctx, bytes)
		if took := time.Since(t0); reg.MappedBytes() != before {
			r.rec.add("grow", took) // one Allocate + fd transfer + mapping
		}
		if err != nil {
			return err
		}
		ps := reg.PageSize()
		r.st.pagesMapped.Add(int64((reg.MappedBytes() - before) / ps))
		r.gen++
		for p := before / ps; p < reg.MappedBytes()/ps; p++ {
			if _, err := reg.WriteAt(r.stamp(i, int(p), r.gen), int64(p*ps)); err != nil {
				return err
			}
			r.stamps[i][p] = r.gen
		}
	}
	r.cells = cells
	return nil
}

// check verifies the stamp of every mapped page.
func (r *runner) check() {
	buf := make([]byte, 16)
	t0 := time.Now()
	for i, reg := range r.regions {
		ps := reg.PageSize()
		for p := uint64(0); p < reg.MappedBytes()/ps; p++ {
			r.st.checked.Add(1)
			if _, err := reg.ReadAt(buf, int64(p*ps)); err != nil || string(buf) != string(r.stamp(i, int(p), r.stamps[i][p])) {
				r.st.bad.Add(1)
				r.log.Error("page check failed", "runner", r.id, "region", i, "page", p, "err", err)
			}
		}
	}
	r.rec.add("check", time.Since(t0))
}

// trim keeps the first cells of every region.
func (r *runner) trim(ctx context.Context, cells int) error {
	r.check()
	bytes := uint64(cells * r.cfg.cellBytes)
	for i, reg := range r.regions {
		before := reg.MappedBytes()
		t0 := time.Now()
		err := reg.Trim(ctx, bytes)
		if took := time.Since(t0); reg.MappedBytes() != before {
			r.rec.add("trim", took) // unmapping + one Free
		}
		if err != nil {
			return err
		}
		ps := reg.PageSize()
		r.st.pagesFreed.Add(int64((before - reg.MappedBytes()) / ps))
		for p := reg.MappedBytes() / ps; p < before/ps; p++ {
			r.stamps[i][p] = 0
		}
	}
	if cells < r.cells {
		r.cells = cells
	}
	return nil
}

func (r *runner) onReclaim(ctx context.Context, rc kvcached.Reclaim) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.st.reclaims.Add(1)
	if err := r.trim(ctx, 0); err != nil {
		r.st.errs.Add(1)
		r.log.Warn("trim on reclaim", "err", err)
	}
}

// request: a prompt and its generation grow the context from cell 0 in
// steps of 256 cells; when the slot finishes the cache is trimmed to a
// kept prefix (a cached prompt) or to nothing.
func (r *runner) request(ctx context.Context, rng *rand.Rand) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.st.requests.Add(1)
	target := (1 + rng.Intn(r.cfg.cells/r.cfg.step)) * r.cfg.step
	for n := r.cfg.step; n <= target; n += r.cfg.step {
		if n <= r.cells {
			continue
		}
		if err := r.grow(ctx, n); err != nil {
			if errors.Is(err, kvcached.ErrResourceExhausted) {
				r.st.exhausted.Add(1)
				break // the request is cut short, as a full KV cache would
			}
			return err
		}
	}
	keep := 0
	if rng.Intn(2) == 0 {
		keep = rng.Intn(r.cells/r.cfg.step+1) * r.cfg.step
	}
	return r.trim(ctx, keep)
}

func main() {
	var cfg config
	flag.StringVar(&cfg.socket, "socket", "", "daemon socket (default: $OLLAMA_KVCACHED_SOCKET, then $KVCACHED_SOCKET)")
	flag.IntVar(&cfg.runners, "runners", 4, "runners (models), one session each")
	flag.IntVar(&cfg.layers, "layers", 8, "layers per runner (one K and one V region each)")
	flag.IntVar(&cfg.cells, "ctx", 4096, "context size in cells (num_ctx x parallel)")
	flag.IntVar(&cfg.cellBytes, "cell-bytes", 2048, "bytes per cell per tensor (n_embd_gqa x type size)")
	flag.IntVar(&cfg.step, "step", 256, "growth step in cells (llama.cpp pads n_kv to 256)")
	flag.DurationVar(&cfg.duration, "duration", 10*time.Second, "how long to run")
	flag.Float64Var(&cfg.idle, "idle", 0.3, "probability that a runner idles (up to 200ms) between requests")
	flag.DurationVar(&cfg.wait, "wait", 0, "unused until the daemon waits: Allocate wait time")
	flag.Int64Var(&cfg.seed, "seed", 1, "random seed")
	flag.BoolVar(&cfg.jsonOut, "json", false, "print the result as JSON")
	flag.BoolVar(&cfg.verbose, "v", false, "debug logging")
	flag.Parse()
	os.Exit(run(&cfg))
}

func run(cfg *config) int {
	level := slog.LevelWarn
	if cfg.verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if cfg.runners < 1 || cfg.layers < 1 || cfg.step < 1 || cfg.cells < cfg.step || cfg.cellBytes < 1 {
		fmt.Fprintln(os.Stderr, "kvcached-loadgen: -runners, -layers, -step, -cell-bytes must be >= 1 and -ctx >= -step")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var c *kvcached.Client
	var err error
	if cfg.socket != "" {
		c, err = kvcached.Dial(dctx, cfg.socket, kvcached.WithLogger(log))
	} else {
		c, err = kvcached.FromEnv(dctx, kvcached.WithLogger(log))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvcached-loadgen:", err)
		return 1
	}
	defer c.Close()

	rec := &recorder{lat: map[string][]time.Duration{}}
	st := &stats{}
	var runners []*runner
	var backend string
	var pageSize uint64
	transport := "grpc"
	for i := 0; i < cfg.runners; i++ {
		r := &runner{id: i, cfg: cfg, rec: rec, st: st, log: log}
		digest := fmt.Sprintf("sha256:%x", sha256.Sum256([]byte(fmt.Sprintf("loadgen-model-%d", i))))
		s, err := c.OpenSession(dctx, digest, kvcached.WithLabels(map[string]string{"model_digest": digest, "runner": "kvcached-loadgen"}),
			kvcached.WithReclaimHandler(r.onReclaim))
		if err != nil {
			fmt.Fprintln(os.Stderr, "kvcached-loadgen:", err)
			return 1
		}
		r.sess = s
		defer s.Close(context.Background())
		if s.ChannelRequests() {
			transport = "fd-channel"
		}
		for j := 0; j < 2*cfg.layers; j++ {
			reg, err := s.NewRegion(dctx, uint64(cfg.cells*cfg.cellBytes))
			if err != nil {
				fmt.Fprintln(os.Stderr, "kvcached-loadgen:", err)
				return 1
			}
			r.regions = append(r.regions, reg)
			r.stamps = append(r.stamps, make([]uint32, reg.Size()/reg.PageSize()))
			pageSize = reg.PageSize()
			backend = reg.Device().Kind
		}
		runners = append(runners, r)
	}

	// Requests in flight at the end finish (so nothing is abandoned
	// half-way); a signal cancels them.
	start := time.Now()
	end := start.Add(cfg.duration)
	var wg sync.WaitGroup
	for _, r := range runners {
		wg.Add(1)
		go func(r *runner) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(cfg.seed + int64(r.id)))
			for ctx.Err() == nil && time.Now().Before(end) {
				if err := r.request(ctx, rng); err != nil {
					if ctx.Err() != nil {
						return
					}
					st.errs.Add(1)
					log.Warn("request failed", "runner", r.id, "err", err)
					time.Sleep(10 * time.Millisecond)
				}
				if rng.Float64() < cfg.idle {
					select {
					case <-time.After(time.Duration(rng.Intn(200)) * time.Millisecond):
					case <-ctx.Done():
					}
				}
			}
		}(r)
	}
	wg.Wait()
	elapsed := time.Since(start)
	// Final check and clean-up: every page verified once more, then freed.
	for _, r := range runners {
		r.mu.Lock()
		if err := r.trim(context.Background(), 0); err != nil {
			st.errs.Add(1)
		}
		r.mu.Unlock()
	}
	lat, ops := rec.summary()
	res := result{
		Runners: cfg.runners, Layers: cfg.layers, Regions: cfg.runners * 2 * cfg.layers, PageSize: pageSize, Backend: backend,
		Transport: transport, DurationS: elapsed.Seconds(), Ops: ops, OpsPerSec: float64(ops) / elapsed.Seconds(),
		PagesMapped: st.pagesMapped.Load(), PagesFreed: st.pagesFreed.Load(), Requests: st.requests.Load(),
		Exhausted: st.exhausted.Load(), Reclaims: st.reclaims.Load(), CheckedPages: st.checked.Load(),
		BadPages: st.bad.Load(), Errors: st.errs.Load(), Latency: lat,
	}
	if cfg.jsonOut {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(res)
	} else {
		fmt.Printf("kvcached-loadgen: %d runners x %d regions (%s backend, %d KiB pages, requests over %s), %.1fs\n",
			res.Runners, 2*cfg.layers, res.Backend, res.PageSize/1024, res.Transport, res.DurationS)
		fmt.Printf("  %d ops (%.0f ops/s), %d requests, %d pages mapped, %d freed, %d exhausted, %d reclaims answered\n",
			res.Ops, res.OpsPerSec, res.Requests, res.PagesMapped, res.PagesFreed, res.Exhausted, res.Reclaims)
		fmt.Printf("  pages checked %d, bad %d, errors %d\n", res.CheckedPages, res.BadPages, res.Errors)
		ops := make([]string, 0, len(lat))
		for op := range lat {
			ops = append(ops, op)
		}
		sort.Strings(ops)
		for _, op := range ops {
			l := lat[op]
			fmt.Printf("  %-6s n=%-7d p50 %8.1fus  p90 %8.1fus  p99 %8.1fus  max %8.1fus\n", op, l.Count, l.P50, l.P90, l.P99, l.Max)
		}
	}
	if res.BadPages > 0 || res.Errors > 0 {
		return 1
	}
	return 0
}
