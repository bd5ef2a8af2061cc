// Distributed checkpoints of sharded state dicts (layer 4, on nn/ beside fsdp/): save on one
// mesh, load on any other (resharding by box intersection, reading the bytes a rank needs and
// the checksum blocks around them), in the Hugging Face safetensors layout that PyTorch's
// HuggingFaceStorageReader reads.
//
//   nn::StateDict sd = model.state_dict();
//   sd.merge(opt.state_dict(), "optim.");
//   sd.values["train.step"] = int64_t{100};
//   checkpoint::save("ckpt/step-100", sd, world);            // collective over `world`
//   ...                                                      // any other mesh / world size:
//   opt.init_state();
//   nn::StateDict target = model.state_dict();               // the new shards, keyed by FQN
//   target.merge(opt.state_dict(), "optim.");
//   checkpoint::load("ckpt/step-100", target, world);        // fills target in place
//   opt.load_state_dict(target.sub("optim."));               // steps and values
//
// On disk (a directory):
//   shard-{r+1:05}-model-{k:05}-of-{K:05}.safetensors   the chunks rank r wrote; file k holds the
//       k-th chunk of each key rank r owns (one chunk per key per file: PyTorch's reader keys a
//       file's entries by name). __metadata__: DCP_SHARDING_INFO = JSON {key: {"saved_offsets":
//       [...]}} (each chunk's global offset), DCP_VERSION, format "pt" (what PyTorch writes).
//   checkpoint.json   written last by rank 0, to checkpoint.json.tmp then renamed: its presence
//       means complete. Every tensor's global shape, dtype and chunks (offsets, sizes, file,
//       byte_offset, nbytes, xxh64 of the bytes and, for chunks larger than a block, the block
//       shape and each block's xxh64), every file's size, and the non-tensor values.
// A chunk is a box in global coordinates. A rank whose shard is not one box (_StridedShard,
// nested uneven shards, a RaggedShard's flat range: a partial first row, full rows, a partial
// last row, dtensor::flat_range_boxes) writes several. Chunks replicated over ranks are written once: each rank
// plans its own chunks from its coordinate and the specs (checkpoint/save_plan.h), and rank 0
// writes checkpoint.json from what the ranks report (one gather, and the commit's agreement).
//
// Errors: kernels::InvalidArgument naming the directory, the key and what differs (missing,
// unexpected, shape, dtype, incomplete, checksum, truncated file, a value out of range, a path
// that is not a regular file); writes: kernels::ResourceError when the device or quota is full
// (naming the path and the bytes), InvalidArgument for a path that cannot be written
// (permission, read-only filesystem, missing directory); kernels/file_io.h. A load that fails on
// any rank changes no tensor on any rank (everything is read into staging buffers first and the
// ranks agree before copying).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "nn/module.h"
#include "nn/state_dict.h"

namespace checkpoint {

using dtensor::Dims;
using kernels::DType;

inline constexpr const char* kMetadataFile = "checkpoint.json";
// The default block size of block checksums (SaveOptions::block_bytes).
inline constexpr uint64_t kDefaultBlockBytes = uint64_t{64} << 10;

// xxh64 of `n` bytes (seed 0; libxxhash): the chunks' and blocks' checksum.
// xxh64("", 0) == 0xEF46DB3751D8E999.
uint64_t xxh64(const void* data, size_t n, uint64_t seed = 0);

// One saved box of a tensor and where its bytes are (row-major, contiguous).
struct ChunkInfo {
  Dims offsets, sizes;
  std::string file;          // relative to the checkpoint directory (a plain name)
  uint64_t byte_offset = 0;  // of the first byte in the file
  uint64_t nbytes = 0;
  std::optional<uint64_t> checksum;  // xxh64 of the chunk; absent in directories PyTorch wrote
  // Block checksums (absent: empty): the chunk cut by a grid of `block_shape` anchored at the
  // tensor's origin; one xxh64 per block, row-major over the blocks the chunk meets, each over
  // the block's elements in row-major order. A partial read verifies the blocks it overlaps.
  Dims block_shape;
  std::vector<uint64_t> block_checksums;
};

struct TensorInfo {
  Dims shape;
  DType dtype = DType::kF32;
  std::vector<ChunkInfo> chunks;
};

struct Metadata {
  std::vector<std::pair<std::string, TensorInfo>> tensors;  // in save order
  std::map<std::string, nn::StateValue> values;
  std::map<std::string, uint64_t> file_sizes;  // ours only
  bool foreign = false;  // no checkpoint.json: a Hugging Face / PyTorch safetensors directory
  std::string dir;       // the directory the chunks' files are in
  const TensorInfo* find(const std::string& key) const;
};

// Reads a checkpoint's metadata: checkpoint.json, or, in a directory without it that holds
// safetensors files PyTorch (or Hugging Face) wrote, their headers (DCP_SHARDING_INFO offsets;
// a file without it holds whole tensors). `path` may also be one consolidated safetensors file
// (model.safetensors, as Python's save_file writes it) or a Hugging Face index
// (model.safetensors.index.json, as save_pretrained writes it: the files of its weight_map,
// which must hold exactly the tensors it lists). Throws InvalidArgument for a path that is none
// of these, an incomplete checkpoint of ours (data files but no checkpoint.json: the save did not
// finish), malformed metadata (every integer is range-checked; the message names the file, the
// tensor and the field), a file that is not a regular file (a FIFO, a directory: never opened
// for reading), or a data file missing or of the wrong size. Reads no tensor data.
Metadata read_metadata(const std::string& path);

// Host buffers an asynchronous save stages into, kept for the next save: the first save pays for
// allocating and faulting them in, later saves of the same state dict copy into warm memory
// (PyTorch's async_save with a cached staged state dict). One save at a time may use a cache
// (from async_save until its wait()); a second one throws InvalidArgument.
//   auto cache = std::make_shared<checkpoint::StagingCache>();
//   checkpoint::SaveOptions o;  o.staging = cache;   // the same cache for every save of the run
struct StagingCache {
  std::mutex mu;
  bool busy = false;
  std::vector<kernels::Tensor> buffers;  // one per chunk this rank owns, in plan order
};

struct SaveOptions {
  bool fsync = true;  // data files and the metadata reach the disk before the commit
  std::shared_ptr<StagingCache> staging;  // async_save only; nullptr: fresh buffers, freed as written
  // The largest block of block checksums (smaller chunks get smaller blocks, down to 4 KiB:
  // detail::choose_block_shape), so a resharded load verifies what it reads while reading
  // little more than it needs; 0: chunk checksums only. Every rank must pass the same value
  // (checked with the plan).
  uint64_t block_bytes = kDefaultBlockBytes;
};

struct SaveStats {
  uint64_t bytes_written = 0;  // this rank's data bytes
  int files = 0;               // this rank's data files
  double stage_seconds = 0;    // copies to host memory and checksums (the caller is blocked)
  double write_seconds = 0;    // the background writes
};

// A save in flight (async_save). The data files are written by a background thread; wait()
// commits. Destroying a handle that was never waited for joins the writer and commits nothing
// (the directory stays recognisably incomplete).
class SaveHandle {
 public:
  SaveHandle();
  SaveHandle(SaveHandle&&) noexcept;
  SaveHandle& operator=(SaveHandle&&) noexcept;
  ~SaveHandle();
  // True once this rank's files are written (wait() then only does the commit).
  bool ready() const;
  // Collective over the world communicator given to async_save: joins the writer, agrees that
  // every rank wrote its files, rank 0 writes checkpoint.json (temporary name, fsync, rename),
  // and every rank returns once it is committed. Throws (on every rank) when any rank failed.
  SaveStats wait();

  struct State;

 private:
  friend struct SaveAccess;
  std::unique_ptr<State> state_;
};

// Stages this rank's chunks to host memory (copies, checksums: the caller is blocked only for
// that), gathers the checksums, and writes the files in the background; training may modify
// the tensors as soon as this returns. Collective over `world` (group rank i must be global rank
// i, the ranks the DTensors' meshes name); every rank passes the same keys, shapes, dtypes and
// placements (checked). The world communicator must not be used by others until wait() (its
// calls must stay in the same order on every rank). Throws InvalidArgument for a Partial tensor
// (reduce it first), an unsupported dtype, or ranks disagreeing on the state dict.
SaveHandle async_save(const std::string& dir, const nn::StateDict& sd, collectives::Communicator& world,
                      const SaveOptions& options = {});
// async_save(...).wait().
SaveStats save(const std::string& dir, const nn::StateDict& sd, collectives::Communicator& world,
               const SaveOptions& options = {});

enum class Verify {
  kNone,  // nothing is checked; exactly the needed bytes are read
  // Every byte read is checked (the default): a chunk read whole by its xxh64; part of a chunk
  // by the xxh64 of every block it overlaps (those blocks are read whole: a little more than
  // needed); part of a chunk without block checksums (older checkpoints, chunks of one block)
  // by reading the whole chunk. Directories PyTorch wrote carry no checksums: read unverified.
  kRead,
  kAll,  // every chunk this rank touches is read whole and checked by its xxh64
};

struct LoadOptions {
  bool strict = true;  // a checkpoint tensor no key of the target asks for is an error
  Verify verify = Verify::kRead;
  // A floating tensor saved in another floating dtype is converted (a bf16 file into f32 master
  // weights); false: a dtype mismatch is an error naming the key.
  bool convert_dtype = false;
};

struct LoadStats {
  uint64_t bytes_read = 0;    // this rank's reads (verification's extra bytes included)
  uint64_t bytes_needed = 0;  // the stored bytes of this rank's shards (replicated ones count per holder)
  int64_t reads = 0;          // pread calls
};

// Loads the tensors of `sd` (their keys, global shapes, dtypes, meshes and placements say what
// to load; any placements, any world size) in place, and replaces sd.values by the
// checkpoint's (in a foreign directory: its one-element tensors no key asks for, e.g.
// PyTorch's optimizer steps). Each rank reads only the saved bytes overlapping its own boxes,
// grown to whole checksum blocks to verify them (Verify).
// Collective over `world` (one agreement; no data moves between ranks).
LoadStats load(const std::string& dir, nn::StateDict& sd, collectives::Communicator& world,
               const LoadOptions& options = {});

struct PretrainedOptions {
  bool strict = true;  // a stored tensor that is no parameter of the model is an error
  Verify verify = Verify::kRead;
  // Stored keys starting with one of these are skipped (fsdp-train's checkpoints keep the
  // optimizer state under "optim.").
  std::vector<std::string> skip_prefixes;
};

// Loads pretrained weights into `model`'s parameters, shard by shard: each rank reads only the
// stored bytes overlapping its own shards (one pread per contiguous run: a row split reads its
// rows, a column split its column runs), converting dtypes (a bf16 file into f32 parameters).
// `path`: a consolidated Hugging Face safetensors file or index (model.safetensors,
// model.safetensors.index.json), or a checkpoint directory (ours, or one PyTorch's DCP /
// HuggingFaceStorageWriter wrote). The model may be sharded (tensor parallel, fsdp::fully_shard)
// and still meta: its meta parameters are allocated (nn::to_empty: FSDP writes straight into
// its flat buffers) only after the checks pass, and the bytes are read straight into them (no
// staging copy); materialised parameters are staged and written once every rank read
// everything. A missing key, an unexpected one (strict), a shape mismatch or a dtype that is not
// floating throws InvalidArgument naming the key on every rank before anything is allocated or
// written. Collective over `world` (agreements only; no data moves between ranks).
//   nn::GPT model(...);                                   // meta
//   for (auto& [n, b] : model.blocks().children()) fsdp::fully_shard(*b, comms);
//   fsdp::fully_shard(model, comms);                      // records the sharded layout, allocates nothing
//   auto st = checkpoint::load_pretrained("hf/model.safetensors", model, world);
//   // st.bytes_read == st.bytes_needed: this rank's shard and nothing else
LoadStats load_pretrained(const std::string& path, nn::Module& model, collectives::Communicator& world,
                          const PretrainedOptions& options = {});

struct ExportOptions {
  std::string prefix;          // only keys starting with it ("" = all)
  bool strip_prefix = true;    // and without it in the output
  uint64_t max_file_bytes = 0; // 0: one file model.safetensors; else several + the index
};

// Writes the checkpoint consolidated into `out_dir` as Hugging Face safetensors: one
// model.safetensors, or model-0000i-of-0000N.safetensors plus model.safetensors.index.json
// ({"metadata": {"total_size"}, "weight_map"}), loadable by Python's safetensors and PyTorch.
// One process, one tensor in memory at a time; chunk checksums verified (every chunk is read
// whole). Write errors: ResourceError when out of space (naming the path and the bytes),
// InvalidArgument when out_dir cannot be created or written. Returns the files written.
std::vector<std::string> export_safetensors(const std::string& dir, const std::string& out_dir,
                                            const ExportOptions& options = {});

}  // namespace checkpoint
