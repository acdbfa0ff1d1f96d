// Bounded waits on peers: what a kernel spinning on another rank's data needs in order to give up
// after a timeout and tell the host whom it waited for. Plain structs, shared by host and device.
//
// A kernel's waits poll PeerWait::flag every ~1k spins. The first wait past the timeout sets the
// flag (device memory, atomically), writes a PeerWaitRecord into host-mapped pinned memory and
// stops waiting; every other wait of any block sees the flag and stops too. The call's outputs
// are then garbage and the region's protocol state is out of step with the peers: the host reads
// the record (a plain load, no stream sync) before its next call and raises an error naming the
// op, the site and the peer, on that call and every later one.
#pragma once

#include <cstdint>

namespace opfuse {

// Where a wait happened (PeerWaitRecord::site).
enum class PeerWaitSite : int32_t {
  kNone = 0,
  kOneShot = 1,               // one-shot: a peer's pushed values never arrived
  kTwoShotReduceScatter = 2,  // two-shot: a peer's partial rows never arrived
  kTwoShotAllGather = 3,      // two-shot: a peer's reduced rows never arrived
  kLamportReduceScatter = 4,  // Lamport two-shot: a peer's partial rows never arrived
  kLamportAllGather = 5,      // Lamport two-shot: a peer's reduced rows never arrived
};

// The first wait that timed out. Lives in host-mapped pinned memory; ``failed`` is written last.
struct PeerWaitRecord {
  int32_t failed = 0;
  int32_t site = 0;
  int32_t rank = 0;   // this rank, in the region's group
  int32_t peer = 0;   // the rank it waited for
  int32_t op = 0;     // the caller's code for the fused op (PeerWait::op)
  int32_t block = 0;
  uint64_t waited_ns = 0;
};

// How a launch bounds its waits. All pointers are device-visible addresses.
struct PeerWait {
  uint32_t* flag = nullptr;          // device memory, 0 until a wait gives up
  PeerWaitRecord* record = nullptr;  // host-mapped pinned memory
  uint64_t timeout_ns = 0;           // 0: wait forever
  int32_t op = 0;
};

}  // namespace opfuse
