package kvcached

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kvcached/kvcached-service/clients/go/internal/fdchan"
	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Against daemons started with --channel-ops-only: they refuse the gRPC
// Allocate, Free and CloseSession with FAILED_PRECONDITION, so everything
// that works here went over the fd channel. A counting interceptor on the
// client shows that none of those rpcs was even tried.

const channelOpsOnly = "--channel-ops-only"

// rpcCounter counts a client's unary gRPC calls by method name.
type rpcCounter struct {
	mu    sync.Mutex
	calls map[string]int
}

func (r *rpcCounter) option() Option {
	return WithGRPCDialOptions(grpc.WithChainUnaryInterceptor(
		func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			r.mu.Lock()
			r.calls[method[strings.LastIndex(method, "/")+1:]]++
			r.mu.Unlock()
			return invoker(ctx, method, req, reply, cc, opts...)
		}))
}

func (r *rpcCounter) count(methods ...string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, m := range methods {
		n += r.calls[m]
	}
	return n
}

// assertNoSessionRPCs fails the test if the client made a gRPC Allocate,
// Free or CloseSession.
func (r *rpcCounter) assertNoSessionRPCs(t *testing.T) {
	t.Helper()
	if n := r.count("Allocate", "Free", "CloseSession"); n != 0 {
		r.mu.Lock()
		defer r.mu.Unlock()
		t.Fatalf("%d gRPC Allocate/Free/CloseSession calls (%v): something fell back to gRPC", n, r.calls)
	}
}

func dialCounted(t *testing.T, d *daemon) (*Client, *rpcCounter) {
	t.Helper()
	calls := &rpcCounter{calls: map[string]int{}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, d.Socket, calls.option())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, calls
}

func channelOnlyDaemon(t *testing.T, backend string) *daemon {
	t.Helper()
	return sharedDaemonWith(t, backend+channelOpsOnly, backend, channelOpsOnly)
}

// Allocate, Free, Close, errors and a Region on both backends; the gRPC
// versions of the calls are refused for the same session meanwhile.
func TestChannelOpsOnly(t *testing.T) {
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			d := channelOnlyDaemon(t, backend)
			checkGoroutines(t)
			c, calls := dialCounted(t, d)
			ctx := testCtx(t)
			info, err := c.Info(ctx)
			if err != nil || !info.FDChannelRequests || !info.FDChannelRequestsOnly {
				t.Fatalf("GetInfo of a --channel-ops-only daemon: %+v %v", info, err)
			}
			s, err := c.OpenSession(ctx, "go-channel-only")
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close(ctx)
			if !s.ChannelRequests() {
				t.Fatal("the session does not use the fd channel for requests")
			}
			ps := s.Info().Devices[0].PageSize
			a, err := s.Allocate(ctx, 3)
			if err != nil {
				t.Fatal(err)
			}
			a.Close()
			if len(a.Pages) != 3 || a.ID&fdchan.AllocBit == 0 || a.PageSize != ps || a.Device != s.Info().Devices[0].UUID || a.HeldBytes != 3*ps {
				t.Fatalf("allocation %+v", a)
			}
			// A stolen SessionRef is of no use: the gRPC calls (from another
			// connection) are refused for this very session, while the
			// channel serves it.
			ref, _, _ := s.m.Call("test")
			thief, _ := dialCounted(t, d)
			_, err = thief.rpc.Allocate(ctx, &pb.AllocateRequest{Session: ref, NumPages: 1})
			if err = statusToError("Allocate", err); !errors.Is(err, ErrFailedPrecondition) || !strings.Contains(err.Error(), "channel_ops_only") {
				t.Fatalf("raw gRPC Allocate on a --channel-ops-only daemon: %v", err)
			}
			_, err = thief.rpc.Free(ctx, &pb.FreeRequest{Session: ref, PageIds: a.IDs()})
			if err = statusToError("Free", err); !errors.Is(err, ErrFailedPrecondition) {
				t.Fatalf("raw gRPC Free: %v", err)
			}
			_, err = thief.rpc.CloseSession(ctx, &pb.CloseSessionRequest{Session: ref})
			if err = statusToError("CloseSession", err); !errors.Is(err, ErrFailedPrecondition) {
				t.Fatalf("raw gRPC CloseSession: %v", err)
			}
			own, err := s.Own(ctx)
			if err != nil || own.PagesHeld != 3 {
				t.Fatalf("the session holds %+v after refused gRPC calls (%v)", own, err)
			}
			// The daemon's errors arrive as REPLY codes, as the same sentinels.
			check := func(what string, err, want error) {
				t.Helper()
				var e *Error
				if !errors.Is(err, want) || !errors.As(err, &e) || e.Message == "" {
					t.Errorf("%s: got %v, want %v", what, err, want)
				}
			}
			_, err = s.Free(ctx, []uint64{1 << 60})
			check("Free(unknown page)", err, ErrNotFound)
			_, err = s.Free(ctx, []uint64{a.Pages[0].ID, a.Pages[0].ID})
			check("Free(repeated id)", err, ErrInvalidArgument)
			_, err = s.Allocate(ctx, 1, OnDevice("GPU-nope"))
			check("Allocate(unknown device)", err, ErrNotFound)
			_, err = s.Allocate(ctx, int(s.Info().MaxPagesPerRequest)+1)
			check("Allocate(max+1)", err, ErrInvalidArgument)
			_, err = s.Allocate(ctx, int(s.Info().Devices[0].BudgetBytes/ps))
			check("Allocate(over budget)", err, ErrResourceExhausted)
			expired, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
			_, err = s.Allocate(expired, 1)
			cancel()
			check("Allocate(expired deadline)", err, ErrDeadlineExceeded)
			if fr, err := s.Free(ctx, a.IDs()); err != nil || fr.PagesFreed != 3 {
				t.Fatalf("Free: %+v %v", fr, err)
			}
			// Close goes as a CLOSE record: the session is gone at the daemon.
			id := s.ID()
			if err := s.Close(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case <-s.Done():
			case <-time.After(5 * time.Second):
				t.Fatal("the session's reader did not end after Close")
			}
			waitFor(t, 5*time.Second, "no session open after Close", func() (bool, string) {
				st, err := c.Stats(ctx)
				return err == nil && st.SessionsOpen == 0 && st.Total.PagesInUse == 0, fmt.Sprintf("%+v %v", st, err)
			})
			_, err = s.Free(ctx, []uint64{1})
			check(fmt.Sprintf("Free on closed session %d", id), err, ErrFailedPrecondition)

			regionScenario(t, c, backend)
			calls.assertNoSessionRPCs(t)
			if calls.count("GetStats") == 0 {
				t.Fatal("the counter saw no rpc at all")
			}

		})
	}
}

// Reclaim (a handler that trims, for an admin shrink and for a waiting
// Allocate), a request abandoned by its context, and a client SIGKILLed
// while holding pages, on a --channel-ops-only host daemon.
func TestChannelOpsOnlyHost(t *testing.T) {
	d := channelOnlyDaemon(t, "host")
	c, calls := dialCounted(t, d)
	t.Run("reclaim-callback", func(t *testing.T) {
		checkGoroutines(t)
		reclaimCallbackScenario(t, c, "host")
	})
	t.Run("reclaim-waiting-allocate", func(t *testing.T) {
		checkGoroutines(t)
		reclaimWaitingScenario(t, c, "host")
	})
	t.Run("abandoned-allocate", func(t *testing.T) {
		checkGoroutines(t)
		abandonedAllocateScenario(t, c)
	})
	t.Run("sigkill-client", func(t *testing.T) {
		sigkillScenario(t, d, c, "host")
	})
	calls.assertNoSessionRPCs(t)
}

// A waiting Allocate whose context ends before the daemon could reclaim
// returns DeadlineExceeded at once; the pages the daemon delivers later
// are given back, and nothing is left behind.
func abandonedAllocateScenario(t *testing.T, c *Client) {
	ctx := testCtx(t)
	var region atomic.Pointer[Region]
	idle, err := c.OpenSession(ctx, "sha256:slow-to-yield", WithReclaimHandler(func(ctx context.Context, r Reclaim) {
		time.Sleep(400 * time.Millisecond)
		reg := region.Load()
		_ = reg.Trim(ctx, 0)
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close(ctx)
	ps := idle.Info().Devices[0].PageSize
	budget := idle.Info().Devices[0].BudgetBytes / ps
	r, err := idle.NewRegion(ctx, budget*ps)
	if err != nil {
		t.Fatal(err)
	}
	region.Store(r)
	if err := r.Grow(ctx, (budget-4)*ps); err != nil {
		t.Fatal(err)
	}
	busy, err := c.OpenSession(ctx, "sha256:impatient")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close(ctx)
	short, cancel := context.WithTimeout(ctx, 150*time.Millisecond)
	start := time.Now()
	_, err = busy.Allocate(short, 16, WaitUpTo(5*time.Second))
	cancel()
	if !errors.Is(err, ErrDeadlineExceeded) || time.Since(start) > time.Second {
		t.Fatalf("abandoned waiting Allocate: %v after %v", err, time.Since(start))
	}
	// The daemon completes the allocation once the idle session yields;
	// the client gives the pages straight back.
	waitFor(t, 10*time.Second, "the abandoned pages given back", func() (bool, string) {
		st, err := c.Stats(ctx)
		if err != nil {
			return false, err.Error()
		}
		own, err := busy.Own(ctx)
		allocs, waiters := busy.m.Pending()
		left := allocs + waiters
		return err == nil && own.AllocationsTotal >= 1 && own.PagesHeld == 0 && left == 0 && st.Total.PagesInUse == 0,
			fmt.Sprintf("%+v, %d left, %d pages in use", own, left, st.Total.PagesInUse)
	})
}

// A daemon SIGKILLed and restarted (--state-dir) under a resumable
// session: after the resume, requests go on the new fd channel.
func TestChannelOpsOnlyResume(t *testing.T) {
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			checkGoroutines(t)
			resumeScenario(t, backend, channelOpsOnly)
		})
	}
}

// On a daemon that also serves the gRPC page rpcs (--grpc-page-ops, for
// tools), the client still makes its page operations on the fd channel
// only (it has no gRPC page path since issue 16), while a tool holding the
// session's reference may Allocate and Free over gRPC there.
func TestGRPCPageOpsDaemon(t *testing.T) {
	forEachBackend(t, func(t *testing.T, backend string) {
		d := sharedDaemonWith(t, backend+"-grpc-page-ops", backend, "--grpc-page-ops")
		checkGoroutines(t)
		c, calls := dialCounted(t, d)
		regionScenario(t, c, backend)
		calls.assertNoSessionRPCs(t)

		ctx := testCtx(t)
		s, err := c.OpenSession(ctx, "go-grpc-page-ops")
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close(ctx)
		ref, _, _ := s.m.Call("test")
		tool, _ := dialCounted(t, d)
		a, err := tool.rpc.Allocate(ctx, &pb.AllocateRequest{Session: ref, NumPages: 2})
		if err != nil {
			t.Fatalf("a tool's gRPC Allocate on a --grpc-page-ops daemon: %v", err)
		}
		// Its pages reach the session's channel unasked: the client gives
		// them back at once (the stash rule), so the session ends up empty.
		waitFor(t, 10*time.Second, "the unasked pages given back", func() (bool, string) {
			own, err := s.Own(ctx)
			return err == nil && own.HeldBytes == 0, fmt.Sprintf("%+v %v (allocation %d)", own, err, a.GetAllocationId())
		})
		calls.assertNoSessionRPCs(t)
	})
}
