// Package kvcached is the Go client of kvcached-service, the per-host daemon
// that lends KV-cache memory pages (GPU or host memory) to processes.
//
// A Client talks to the daemon's control plane (gRPC on a Unix socket). A
// Session is bound to an fd channel on which the daemon sends the pages'
// descriptors; when the session's process dies the daemon takes its pages
// back. A Region reserves address space once and maps and unmaps
// page-aligned ranges of it with daemon pages. See README.md.
package kvcached

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "github.com/kvcached/kvcached-service/clients/go/internal/kvcachedpb"
)

// Environment variables.
const (
	// EnvOllamaSocket is the socket path Ollama passes to its runners.
	EnvOllamaSocket = "OLLAMA_KVCACHED_SOCKET"
	// EnvSocket is the project's own socket variable.
	EnvSocket = "KVCACHED_SOCKET"
	// EnvLibCUDA selects the CUDA driver library (default libcuda.so.1).
	EnvLibCUDA = "KVCACHED_LIBCUDA"
	// EnvKeepHandles: the most CUDA page handles a session keeps for pages
	// it freed (default 8192; 0: never keep): README.md, "Kept handles (CUDA)".
	EnvKeepHandles = "KVCACHED_KEEP_HANDLES"
)

// Client is a connection to the daemon's control plane. It is safe for
// concurrent use.
type Client struct {
	conn   *grpc.ClientConn
	rpc    pb.KVCachedClient
	health healthpb.HealthClient
	socket string
	log    *slog.Logger
}

// Option configures Dial and FromEnv.
type Option func(*clientOptions)

type clientOptions struct {
	logger   *slog.Logger
	dialOpts []grpc.DialOption
}

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(o *clientOptions) { o.logger = l } }

// WithGRPCDialOptions adds grpc dial options (interceptors, for example).
func WithGRPCDialOptions(opts ...grpc.DialOption) Option {
	return func(o *clientOptions) { o.dialOpts = append(o.dialOpts, opts...) }
}

// Dial connects to the daemon's control socket. The connection is made
// lazily by gRPC; Dial checks that the socket exists and that the daemon
// answers GetInfo before ctx ends, so a wrong path fails here.
func Dial(ctx context.Context, socket string, opts ...Option) (*Client, error) {
	o := clientOptions{logger: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	if socket == "" {
		return nil, newError(ErrNoSocket, "Dial", "empty socket path")
	}
	if _, err := os.Stat(socket); err != nil {
		return nil, newError(ErrNoSocket, "Dial", "%v (is kvcached-serve running?)", err)
	}
	dopts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Reconnect quickly after a daemon restart (sessions resume as soon
		// as it is back): 50 ms doubling to at most 1 s between attempts.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 2, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
	}, o.dialOpts...)
	conn, err := grpc.NewClient("unix://"+socket, dopts...)
	if err != nil {
		return nil, newError(ErrInvalidArgument, "Dial", "%v", err)
	}
	c := &Client{
		conn:   conn,
		rpc:    pb.NewKVCachedClient(conn),
		health: healthpb.NewHealthClient(conn),
		socket: socket,
		log:    o.logger.With("kvcached_socket", socket),
	}
	if _, err := c.Info(ctx); err != nil {
		conn.Close()
		return nil, err
	}
	return c, nil
}

// SocketFromEnv returns the socket named by OLLAMA_KVCACHED_SOCKET, else
// KVCACHED_SOCKET; ErrNoSocket when neither is set.
func SocketFromEnv() (string, error) {
	for _, k := range []string{EnvOllamaSocket, EnvSocket} {
		if v := os.Getenv(k); v != "" {
			return v, nil
		}
	}
	return "", newError(ErrNoSocket, "FromEnv", "neither %s nor %s is set; set one to the daemon's socket path (kvcached-serve --socket, default /tmp/kvcached.sock)", EnvOllamaSocket, EnvSocket)
}

// FromEnv dials the socket named by OLLAMA_KVCACHED_SOCKET, else
// KVCACHED_SOCKET.
func FromEnv(ctx context.Context, opts ...Option) (*Client, error) {
	socket, err := SocketFromEnv()
	if err != nil {
		return nil, err
	}
	return Dial(ctx, socket, opts...)
}

// Socket is the control socket path this client dialled.
func (c *Client) Socket() string { return c.socket }

// Close closes the connection. Sessions opened with this client must be
// closed first (their pages return to the pool either way when the process
// exits).
func (c *Client) Close() error { return c.conn.Close() }

// Device describes one device the daemon serves.
type Device struct {
	UUID        string // "GPU-xxxxxxxx-..." for CUDA, "HOST-0" for the host backend
	Name        string
	Kind        string // "host" or "cuda": how pages are mapped
	PageSize    uint64
	Granularity uint64
	TotalBytes  uint64
	BudgetBytes uint64
}

// Info is what GetInfo reports.
type Info struct {
	Version            string
	APIVersion         uint32
	FDSocket           string
	FDProtocolVersion  uint32
	Backend            string
	Devices            []Device
	MaxPagesPerRequest uint32
	// FDChannelRequests: the daemon serves Allocate, Free and CloseSession
	// as request records on the session's own fd channel (sessions then use
	// it: no token travels, the kernel names the sender).
	FDChannelRequests bool
	// FDChannelRequestsOnly: the daemon refuses the gRPC versions of those
	// calls (kvcached-serve --channel-ops-only).
	FDChannelRequestsOnly bool
	// FDChannelKeepHandles: the daemon honours FREE's keep flag and asks
	// for kept handles with DROP before it releases a page
	// (docs/protocol.md, "Kept handles"); sessions then keep the imported
	// handles of CUDA pages (KVCACHED_KEEP_HANDLES).
	FDChannelKeepHandles bool
	// FDChannelStandby: the daemon honours FREE's standby flag and USE
	// (docs/protocol.md, "Standby pages"); Region.UnmapStandby and
	// Region.TrimStandby then keep pages mapped as standby (else they
	// give them back as Unmap and Trim do).
	FDChannelStandby bool
}

func deviceFromPB(d *pb.DeviceInfo) Device {
	return Device{UUID: d.GetUuid(), Name: d.GetName(), Kind: d.GetKind(), PageSize: d.GetPageSize(),
		Granularity: d.GetGranularity(), TotalBytes: d.GetTotalBytes(), BudgetBytes: d.GetBudgetBytes()}
}

// Info asks the daemon for its version, fd socket and devices.
func (c *Client) Info(ctx context.Context) (*Info, error) {
	r, err := c.rpc.GetInfo(ctx, &pb.GetInfoRequest{})
	if err != nil {
		return nil, statusToError("GetInfo", err)
	}
	info := &Info{Version: r.GetVersion(), APIVersion: r.GetApiVersion(), FDSocket: r.GetFdSocket(),
		FDProtocolVersion: r.GetFdProtocolVersion(), Backend: r.GetBackend(), MaxPagesPerRequest: r.GetMaxPagesPerRequest(),
		FDChannelRequests: r.GetFdChannelRequests(), FDChannelRequestsOnly: r.GetFdChannelRequestsOnly(),
		FDChannelKeepHandles: r.GetFdChannelKeepHandles(), FDChannelStandby: r.GetFdChannelStandby()}
	for _, d := range r.GetDevices() {
		info.Devices = append(info.Devices, deviceFromPB(d))
	}
	return info, nil
}

// Healthy reports whether the daemon's health service says SERVING.
func (c *Client) Healthy(ctx context.Context) error {
	r, err := c.health.Check(ctx, &healthpb.HealthCheckRequest{Service: "kvcached.v1.KVCached"})
	if err != nil {
		return statusToError("Health.Check", err)
	}
	if r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return newError(ErrUnavailable, "Health.Check", "daemon reports %v", r.GetStatus())
	}
	return nil
}

// PoolStats is the budget accounting of a device (or all devices):
// PooledBytes + InUseBytes + FreeBytes == BudgetBytes.
type PoolStats struct {
	BudgetBytes        uint64
	PooledBytes        uint64
	InUseBytes         uint64
	FreeBytes          uint64
	PageSize           uint64
	PagesPooled        uint64
	PagesInUse         uint64
	PagesCreatedTotal  uint64
	PagesReleasedTotal uint64
	// StandbyBytes: held pages that their sessions keep mapped as standby
	// (docs/protocol.md, "Standby pages"), part of InUseBytes.
	StandbyBytes uint64
}

// DeviceStats pairs a device with its pool numbers.
type DeviceStats struct {
	Device Device
	Pool   PoolStats
}

// SessionStats is the daemon's book of one session.
type SessionStats struct {
	ID               uint64
	Name             string
	PID, UID         uint32
	HeldBytes        uint64 // summed over devices
	PagesHeld        uint64
	GuaranteedBytes  uint64
	MaxBytes         uint64
	Priority         int32
	LastActive       time.Time
	Opened           time.Time
	ReclaimIgnored   uint64
	AllocationsTotal uint64
	FreesTotal       uint64
	Labels           map[string]string
	// HeldBytesByDevice is HeldBytes per device uuid (Device.UUID); devices
	// the session holds nothing on are absent.
	HeldBytesByDevice map[string]uint64
	// ReclaimPendingPages: pages the daemon has asked the session for and
	// still waits for; ReclaimRequests: reclaim requests sent over its life.
	ReclaimPendingPages uint64
	ReclaimRequests     uint64
	// StandbyBytes: held bytes the session keeps mapped as standby, not in
	// use (docs/protocol.md, "Standby pages"), part of HeldBytes.
	StandbyBytes uint64
}

// Stats is a GetStats snapshot.
type Stats struct {
	Total        PoolStats
	Devices      []DeviceStats
	Sessions     []SessionStats
	Uptime       time.Duration
	SessionsOpen uint32
}

func poolFromPB(p *pb.PoolStats) PoolStats {
	return PoolStats{BudgetBytes: p.GetBudgetBytes(), PooledBytes: p.GetPooledBytes(), InUseBytes: p.GetInUseBytes(),
		FreeBytes: p.GetFreeBytes(), PageSize: p.GetPageSize(), PagesPooled: p.GetPagesPooled(), PagesInUse: p.GetPagesInUse(),
		PagesCreatedTotal: p.GetPagesCreatedTotal(), PagesReleasedTotal: p.GetPagesReleasedTotal(),
		StandbyBytes: p.GetStandbyBytes()}
}

func unixTime(f float64) time.Time {
	if f == 0 {
		return time.Time{}
	}
	return time.Unix(0, int64(f*1e9))
}

func sessionStatsFromPB(s *pb.SessionStats) SessionStats {
	labels := make(map[string]string, len(s.GetLabels()))
	for k, v := range s.GetLabels() {
		labels[k] = v
	}
	byDevice := make(map[string]uint64, len(s.GetHeldBytesByDevice()))
	for k, v := range s.GetHeldBytesByDevice() {
		if v > 0 {
			byDevice[k] = v
		}
	}
	return SessionStats{ID: s.GetId(), Name: s.GetName(), PID: s.GetPid(), UID: s.GetUid(), HeldBytes: s.GetHeldBytes(),
		HeldBytesByDevice: byDevice, PagesHeld: s.GetPagesHeld(), GuaranteedBytes: s.GetGuaranteedBytes(),
		MaxBytes: s.GetMaxBytes(), Priority: s.GetPriority(), LastActive: unixTime(s.GetLastActiveUnix()),
		Opened: unixTime(s.GetOpenedUnix()), ReclaimIgnored: s.GetReclaimIgnored(), AllocationsTotal: s.GetAllocationsTotal(),
		FreesTotal: s.GetFreesTotal(), Labels: labels, ReclaimPendingPages: s.GetReclaimPendingPages(),
		ReclaimRequests: s.GetReclaimRequests(), StandbyBytes: s.GetStandbyBytes()}
}

func statsFromPB(r *pb.GetStatsResponse) *Stats {
	st := &Stats{Total: poolFromPB(r.GetTotal()), Uptime: time.Duration(r.GetUptimeSeconds() * float64(time.Second)),
		SessionsOpen: r.GetSessionsOpen()}
	for _, d := range r.GetDevices() {
		st.Devices = append(st.Devices, DeviceStats{Device: deviceFromPB(d.GetDevice()), Pool: poolFromPB(d.GetPool())})
	}
	for _, s := range r.GetSessions() {
		st.Sessions = append(st.Sessions, sessionStatsFromPB(s))
	}
	return st
}

// Stats returns global and per-device numbers (no session numbers; use
// Session.Stats for those).
func (c *Client) Stats(ctx context.Context) (*Stats, error) {
	r, err := c.rpc.GetStats(ctx, &pb.GetStatsRequest{})
	if err != nil {
		return nil, statusToError("GetStats", err)
	}
	return statsFromPB(r), nil
}

var _ = fmt.Sprintf
