package kvcached

import (
	"context"
	"sync"
)

// regionSet is a session's regions and the mappers they use: one per
// device, made on first use by the backend of the device's kind
// (mapperBackends). It is the regions' pager: their pages come from the
// session's Allocate and go back with its Free.
type regionSet struct {
	s *Session

	// mu guards regions and mappers. Close marks the Mux closed before it
	// takes the regions, and add checks the Mux under mu, so no region is
	// added after Close took them.
	mu      sync.Mutex
	regions map[*Region]struct{}
	mappers map[string]mapper
}

func newRegionSet(s *Session) *regionSet {
	return &regionSet{s: s, regions: map[*Region]struct{}{}, mappers: map[string]mapper{}}
}

// add reserves a region of size bytes for pages of dev.
func (rs *regionSet) add(dev Device, size uint64) (*Region, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if err := rs.s.m.ClosedErr("NewRegion"); err != nil {
		return nil, err
	}
	m, err := rs.mapperLocked(dev)
	if err != nil {
		return nil, err
	}
	r, err := newRegion(rs, m, dev, size)
	if err != nil {
		return nil, err
	}
	rs.regions[r] = struct{}{}
	return r, nil
}

// mapperLocked returns the mapper for a device (rs.mu held).
func (rs *regionSet) mapperLocked(dev Device) (mapper, error) {
	if m, ok := rs.mappers[dev.UUID]; ok {
		return m, nil
	}
	m, err := newMapper(dev, rs.s.kept)
	if err != nil {
		return nil, err
	}
	rs.mappers[dev.UUID] = m
	return m, nil
}

// list returns the regions (Session.Close releases them).
func (rs *regionSet) list() []*Region {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	regions := make([]*Region, 0, len(rs.regions))
	for r := range rs.regions {
		regions = append(regions, r)
	}
	return regions
}

// closeMappers closes every mapper (the session is closed: no region is
// added any more), after releasing every kept handle.
func (rs *regionSet) closeMappers() {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.s.kept.Reset(0, true)
	for _, m := range rs.mappers {
		m.close()
	}
	rs.mappers = nil
}

// The pager interface.

func (rs *regionSet) allocatePages(ctx context.Context, n int, device string) (*Allocation, error) {
	return rs.s.Allocate(ctx, n, OnDevice(device))
}

func (rs *regionSet) freePages(ctx context.Context, ids []uint64) error {
	_, err := rs.s.Free(ctx, ids)
	return err
}

func (rs *regionSet) standbyOK() bool { return rs.s.info.FDChannelStandby }

func (rs *regionSet) standbyPages(ctx context.Context, ids []uint64) error {
	_, err := rs.s.Standby(ctx, ids)
	return err
}

func (rs *regionSet) usePages(ids []uint64) { rs.s.Use(ids) }

func (rs *regionSet) forget(r *Region) {
	rs.mu.Lock()
	delete(rs.regions, r)
	rs.mu.Unlock()
}
